"""The ``posttrain`` commands: the CLI (``fit``/``validate``/``predict`` through LightningCLI), config parsing,
``estimate``, ``preprocess``, ``export``, and the W&B logger the configs name."""
