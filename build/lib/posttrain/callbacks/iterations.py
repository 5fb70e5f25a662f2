"""``global_step`` counts iterations, not optimizer steps.

Lightning advances ``global_step`` on every ``LightningOptimizer.step()``: a method stepping a critic
and a student would count two per batch. The base steps raw optimizers and this callback advances the
manual-optimization progress once per training batch. Lightning runs checkpoint callbacks last, so
``ModelCheckpoint(every_n_train_steps=N)`` and ``max_steps`` see the new count.
"""
from __future__ import annotations

from lightning.pytorch import Callback


class IterationCounter(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        progress = trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        progress.increment_ready()
        progress.increment_completed()
