"""The ``posttrain`` commands: the CLI (``fit``/``validate``/``predict`` through LightningCLI) and config parsing,
``estimate``, ``preprocess``, ``export``, ``reward`` (check a config's reward), ``serve-reward`` (a reward behind an
HTTP server), and the W&B logger the configs name."""
