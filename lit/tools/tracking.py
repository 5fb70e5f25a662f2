"""Weights & Biases, as Lightning's ``WandbLogger`` with the defaults a run of this package wants.

- offline unless told (``offline: false`` after ``wandb login``), project ``posttrain``;
- the run folder exists before W&B starts, so it finds the git repository above it instead of warning
  that its root "does not exist";
- no ``anonymous`` setting (Lightning always passes one, which wandb >= 0.19 warns has no effect);
- ``id`` / ``job_type`` / ``group`` are set by the CLI: a resumed fit continues its W&B run, validate and
  predict runs are tagged by job type and grouped with the fit run.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger


class WandbLogger(LightningWandbLogger):
    """Args: as Lightning's ``WandbLogger``; ``offline`` defaults to true and ``project`` to ``posttrain``."""

    def __init__(self, name: Optional[str] = None, save_dir: str = ".", version: Optional[str] = None,
                 offline: bool = True, project: str = "posttrain", log_model: bool = False,
                 job_type: Optional[str] = None, group: Optional[str] = None, id: Optional[str] = None,
                 **kwargs: Any):
        os.makedirs(save_dir, exist_ok=True)
        extra = {k: v for k, v in (("job_type", job_type), ("group", group)) if v is not None}
        super().__init__(name=name, save_dir=save_dir, version=version, offline=offline, project=project,
                         log_model=log_model, id=id, **extra, **kwargs)
        self._wandb_init.pop("anonymous", None)
