"""The parts the methods are made of, with no Lightning: cards of named experts (``cards``, ``presets``, the
generator families in ``generators/``), the one sampler (``samplers``), losses, advantages and GRPO settings,
rollouts, refiners, rewards (``rewards``, ``preference``, ``intent``, ``remote``), weight versions and sync plans,
the embedding cache, the on-disk checkpoint protocol (``checkpoints``), the synthetic world (``world``,
``requests``) and its metrics (``geneval``, ``frechet``).
"""
