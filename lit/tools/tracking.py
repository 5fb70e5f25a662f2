"""Weights & Biases, as Lightning's ``WandbLogger`` with the defaults a run of this package wants.

- offline unless told (``offline: false`` after ``wandb login``), project ``posttrain``;
- the run folder exists before W&B starts, so it finds the git repository above it instead of warning
  that its root "does not exist"; it is made then, not when the logger is built;
- no ``anonymous`` setting (Lightning always passes one, which wandb >= 0.19 warns has no effect);
- ``id`` / ``job_type`` / ``group`` are set by the CLI: a resumed fit continues its W&B run, validate and
  predict runs are tagged by job type and grouped with the fit run;
- ``hold`` / ``release``: the CLI holds the logger until the launch is accepted (config parsed, model built,
  checkpoint restored), so that a launch refused at start-up starts no W&B run and makes no folder.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from lightning.fabric.loggers.logger import _DummyExperiment
from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only


class WandbLogger(LightningWandbLogger):
    """Args: as Lightning's ``WandbLogger``; ``offline`` defaults to true and ``project`` to ``posttrain``."""

    def __init__(self, name: Optional[str] = None, save_dir: str = ".", version: Optional[str] = None,
                 offline: bool = True, project: str = "posttrain", log_model: bool = False,
                 job_type: Optional[str] = None, group: Optional[str] = None, id: Optional[str] = None,
                 **kwargs: Any):
        extra = {k: v for k, v in (("job_type", job_type), ("group", group)) if v is not None}
        super().__init__(name=name, save_dir=save_dir, version=version, offline=offline, project=project,
                         log_model=log_model, id=id, **extra, **kwargs)
        self._wandb_init.pop("anonymous", None)
        self._held: Optional[list[tuple[str, tuple, dict]]] = None  # calls kept while held (None: not held)

    # ------------------------------------------------------------------ held until the launch is accepted
    def hold(self) -> None:
        """Start no W&B run and make no folder until ``release``; what is logged meanwhile (Lightning logs the
        hyper-parameters before it restores a checkpoint) is kept and sent then."""
        if self._experiment is None:
            self._held = []

    def release(self) -> None:
        """Start the W&B run (on global rank 0) and send what was logged while held."""
        held, self._held = self._held or [], None
        _ = self.experiment
        for method, args, kwargs in held:
            getattr(self, method)(*args, **kwargs)

    @property
    def experiment(self):
        if self._held is not None:  # Lightning touches it at setup, before the launch is accepted
            return _DummyExperiment()
        if self._experiment is None and self.save_dir and rank_zero_only.rank == 0:
            os.makedirs(self.save_dir, exist_ok=True)
        return super().experiment

    def log_hyperparams(self, params: Any) -> None:
        if self._held is not None:
            self._held.append(("log_hyperparams", (params,), {}))
            return
        super().log_hyperparams(params)

    def log_metrics(self, metrics: Any, step: Optional[int] = None) -> None:
        if self._held is not None:
            self._held.append(("log_metrics", (metrics,), {"step": step}))
            return
        super().log_metrics(metrics, step)
