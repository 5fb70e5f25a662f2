"""Models: cards of named experts, presets, generator families, refiner LMs, versions, caches, VAEs."""
