"""posttrain: post-training of video and image generators and the language models around them.

The repository's top-level folders install as one import package: ``posttrain.lit`` (methods, CLI),
``posttrain.modules`` (plain torch/diffusers/transformers code), ``posttrain.datamodules`` and
``posttrain.callbacks``. ``python -m posttrain`` is the ``posttrain`` command.
"""
__version__ = "0.2.0"
