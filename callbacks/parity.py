"""Log-probability parity between rollout and training: a rollout step's log p, recomputed for the update
under the weights that sampled it, must reproduce the captured one (PPO ratio 1).

A method that rolls out with captured log-probs and recomputes them for its update (flow_grpo,
joint_rl, workflow_rl) calls ``report_rollout(self, probe)`` after each rollout and before the batch's first
update. ``probe()`` recomputes the rollout's per-step log p under the current — still unchanged — weights and
returns max |recomputed − stored| (``modules.rl.rollout.Rollout.logprob_gap`` for a generator, and
``modules.models.refiners.refiner_logprob_gap`` for a refiner's tokens). Callbacks implementing
``on_rollout_captured(trainer, pl_module, probe)`` receive it; they depend on this hook, never on a method class.
"""
from __future__ import annotations

from typing import Callable, Literal

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_warn

RolloutProbe = Callable[[], torch.Tensor]  # () -> max |Δ log p| over the rollout's SDE steps


class LogProbParityError(RuntimeError):
    """The recomputed log p of a rollout differs from the captured one at the rollout's own weights."""


C2ViolationError = LogProbParityError  # the former name


def report_rollout(pl_module, probe: RolloutProbe) -> None:
    """Hand ``probe`` to every callback of the trainer that implements ``on_rollout_captured``."""
    trainer = pl_module.trainer
    for callback in trainer.callbacks:
        hook = getattr(callback, "on_rollout_captured", None)
        if callable(hook):
            hook(trainer, pl_module, probe)


class LogProbParityCheck(Callback):
    """Checks log-probability parity before the first update of every ``every_n_iterations``-th batch: the
    rollout's log p recomputed at the rollout's weights must equal the captured one (PPO ratio 1).
    Logs the largest gap, max |recomputed − captured log p|, as ``train/logprob_parity_gap``; above ``tolerance``
    it warns or raises.

    Args:
        every_n_iterations: check every this many iterations (the first is always checked).
        tolerance: largest acceptable max |Δ log p| (float32 on CPU reproduces to ~1e-6).
        on_violation: ``raise`` stops training with the gap and the likely causes; ``warn`` continues.
    """

    def __init__(self, every_n_iterations: int = 1, tolerance: float = 1e-5,
                 on_violation: Literal["warn", "raise"] = "raise"):
        if every_n_iterations < 1:
            raise ValueError(f"LogProbParityCheck: every_n_iterations={every_n_iterations} must be >= 1")
        if tolerance < 0:
            raise ValueError(f"LogProbParityCheck: tolerance={tolerance} must be >= 0")
        if on_violation not in ("warn", "raise"):
            raise ValueError(f"LogProbParityCheck: on_violation={on_violation!r}; choose 'warn' or 'raise'")
        self.every, self.tolerance, self.on_violation = every_n_iterations, tolerance, on_violation
        self.reported = False
        self.last_gap: float | None = None
        self.checks = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.reported = False

    def on_rollout_captured(self, trainer, pl_module, probe: RolloutProbe) -> None:
        self.reported = True
        if trainer.global_step % self.every:
            return
        gap = float(probe())
        self.last_gap, self.checks = gap, self.checks + 1
        pl_module.log("train/logprob_parity_gap", gap, on_step=True)
        if gap <= self.tolerance:  # NaN fails this comparison too
            return
        message = (f"log-probability parity violated at iteration {trainer.global_step}: max |recomputed - stored "
                   f"log p| = {gap:.3g} > tolerance {self.tolerance:g}. Rollout and recompute differ at the same "
                   f"weights: check that both use the same sampler (guidance scale, noise level, σ schedule), "
                   f"conditioning and eval-mode (no dropout) model, and that no update ran before the check.")
        if self.on_violation == "raise":
            raise LogProbParityError(message)
        rank_zero_warn(message)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.reported:
            raise RuntimeError(f"LogProbParityCheck: {type(pl_module).__name__} reported no rollout in iteration "
                               f"{trainer.global_step}; the check applies to methods that roll out with captured "
                               f"log-probs and call callbacks.parity.report_rollout (flow_grpo, joint_rl, "
                               f"workflow_rl). Remove LogProbParityCheck from this config.")


class C2Check(LogProbParityCheck):
    """``LogProbParityCheck`` under its former name: configs that name ``C2Check`` (short or by its full path) keep
    working. A subclass, not an alias, so that the short name resolves in YAML too."""
