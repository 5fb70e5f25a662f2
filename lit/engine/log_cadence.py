"""Per-iteration metrics logged at the loggers' cadence, not on every call.

Lightning hands the loggers, every ``trainer.log_every_n_steps`` iterations, the latest value of each on-step
metric, but each ``LightningModule.log`` call costs its bookkeeping (about 0.3 ms on a CPU: eight calls were 15%
of a tiny finetune iteration, bench/overhead.py). ``DeferredLogging.log`` therefore only keeps the latest value
of a per-iteration training metric in an iteration whose metrics reach no logger; the next iteration whose
metrics do (or the run's last) logs what was kept, so loggers get the same values as before.
``trainer.callback_metrics`` and the progress bar refresh at the logging cadence. Epoch-aggregated metrics
(``on_epoch=True``) and every other hook log at once.

A mixin of ``ExpertModule`` (``log`` must be the module's own method, and the kept values are flushed in the
module's ``on_train_batch_end``, which Lightning runs after every callback's and before the loggers update).
It reads Lightning's own decision of when metrics reach the loggers, which Lightning keeps private.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule

# training hooks whose self.log defaults to on_step=True, on_epoch=False
STEP_HOOKS = ("training_step", "on_train_batch_start", "on_train_batch_end")


class DeferredLogging(LightningModule):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._deferred_logs: dict[str, tuple] = {}  # name -> (hook, value, kwargs) of a deferred self.log

    def log(self, name: str, value: Any, prog_bar: bool = False, logger: Optional[bool] = None,
            on_step: Optional[bool] = None, on_epoch: Optional[bool] = None, **kwargs: Any) -> None:
        """``LightningModule.log``, deferred for a per-iteration training metric in an iteration whose metrics
        reach no logger (see the module docstring)."""
        kwargs.update(prog_bar=prog_bar, logger=logger, on_step=on_step, on_epoch=on_epoch)
        fx = self._current_fx_name
        if on_epoch or fx not in STEP_HOOKS or self.log_due:
            self._deferred_logs.pop(name, None)
            super().log(name, value, **kwargs)
        else:
            self._deferred_logs[name] = (fx, value.detach() if isinstance(value, torch.Tensor) else value, kwargs)

    @property
    def log_due(self) -> bool:
        """Whether this training iteration's on-step metrics reach the loggers (Lightning's own decision:
        every ``log_every_n_steps``, or when stopping), or it is the run's last iteration."""
        trainer = self._trainer
        if trainer is None or not trainer.training:
            return True
        due = getattr(trainer._logger_connector, "should_update_logs", True)
        # Lightning's batch count (what should_update_logs uses): global_step moves within the iteration
        iteration = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step) + 1
        last_step = 0 < trainer.max_steps <= iteration
        last_epoch = 0 < (trainer.max_epochs or -1) <= trainer.current_epoch + 1 \
            and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        return due or last_step or last_epoch

    def on_train_epoch_start(self) -> None:
        super().on_train_epoch_start()
        self._deferred_logs.clear()  # none outlives its epoch (Lightning resets its results there)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        # after every callback's on_train_batch_end, before Lightning hands metrics to the loggers; also at an
        # epoch's last batch, where Lightning's callback_metrics took the latest values before its epoch reset
        trainer = self.trainer
        if self._deferred_logs and (self.log_due or trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
                                    or batch_idx + 1 >= trainer.num_training_batches):
            deferred, self._deferred_logs = self._deferred_logs, {}
            current = self._current_fx_name
            for name, (fx, value, kwargs) in deferred.items():
                self._current_fx_name = fx  # Lightning keys a result by the hook that logged it
                super().log(name, value, **kwargs)
            self._current_fx_name = current
