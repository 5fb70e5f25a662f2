"""The ``posttrain`` command: LightningCLI (``fit``, ``validate``, ``predict``) plus ``export``.

    posttrain fit --config configs/finetune.yaml
    posttrain fit --config configs/finetune.yaml --ckpt_path last      # resume
    posttrain predict --config configs/finetune.yaml --ckpt_path last
    posttrain export --ckpt runs/finetune/checkpoints/last.ckpt --out exported/transformer
"""
from __future__ import annotations

import sys
from typing import Optional

from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

from posttrain.lit.base import ExpertModule


class LoggedConfig(SaveConfigCallback):
    """Writes ``config.yaml`` beside the run and puts the whole config into the loggers (W&B config)."""

    def save_config(self, trainer, pl_module, stage: str) -> None:
        for logger in trainer.loggers:
            logger.log_hyperparams(self.config.as_dict())


class PosttrainCLI(LightningCLI):
    def __init__(self, args: Optional[list[str]] = None, **kwargs):
        super().__init__(
            model_class=ExpertModule, subclass_mode_model=True,
            datamodule_class=LightningDataModule, subclass_mode_data=True,
            save_config_callback=LoggedConfig, save_config_kwargs={"overwrite": True},
            args=args, **kwargs,
        )


def main(args: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] == "export":
        from jsonargparse import ArgumentParser

        from posttrain.lit.export import export

        parser = ArgumentParser(prog="posttrain export", description=export.__doc__)
        parser.add_function_arguments(export, as_positional=False)
        print(export(**parser.parse_args(argv[1:]).as_dict()))
        return
    PosttrainCLI(args=argv)


if __name__ == "__main__":
    main()
