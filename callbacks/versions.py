"""Per-component weight versions, bumped when an expert steps, and the sync plans that follow.

Every component of a card has an integer version (0 at load). After each iteration this callback bumps
the version of every expert whose optimizer stepped, runs the sync plans whose source it is (EMA, the
decay-blended ``old`` policy of DiffusionNFT, a ``reference`` refresh, a rollout copy), bumps each
plan's target, and drops only the stepped components' prompt-embedding cache entries. Versions are
logged as ``train/version/<component>`` and travel in checkpoints.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from lightning.pytorch import Callback


@dataclass
class SyncPlan:
    """``target ← d·target + (1-d)·source`` with ``d = decay(source_version)``, every ``every`` versions.

    ``d = 0`` is a copy (rollout copy, reference refresh), a constant ``d`` is an EMA, a schedule of
    the version is DiffusionNFT's ``old`` blend.
    """

    source: str
    target: str
    decay: Callable[[int], float]
    every: int = 1

    @torch.no_grad()
    def apply(self, card, source_version: int) -> bool:
        if source_version % self.every:
            return False
        d = float(self.decay(source_version))
        source, target = _unwrap(card[self.source]), _unwrap(card[self.target])
        # (target, source) tensors by name: parameters, then floating-point buffers
        src = dict(source.named_parameters())
        pairs = [(p, src[name]) for name, p in target.named_parameters()]
        params = len(pairs)
        src_buffers = dict(source.named_buffers())
        pairs += [(b, src_buffers[name]) for name, b in target.named_buffers() if b.is_floating_point()]
        with _gathered([s for _, s in pairs[:params]]), _gathered([t for t, _ in pairs[:params]], modifier=True):
            # one fused lerp over all tensors (torch._foreach, as torch.optim does): a loop of per-tensor
            # lerp_ calls cost twice as much on a small model, where the sync runs every iteration
            if pairs:
                torch._foreach_lerp_([t for t, _ in pairs], [s if s.dtype == t.dtype else s.to(t.dtype)
                                                             for t, s in pairs], 1.0 - d)
        return True


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DeepSpeed engine (``lit.strategy`` puts engines on the card)."""
    return model.module if type(model).__name__ == "DeepSpeedEngine" else model


def _gathered(params: list[torch.nn.Parameter], modifier: bool = False):
    """Full ZeRO-3 ``params`` for the duration (collective: every process runs the sync plans); a
    modified target is written back from rank 0, where every process computed the same values."""
    params = [p for p in params if hasattr(p, "ds_id")]
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modifier else None)


def constant(decay: float) -> Callable[[int], float]:
    return lambda _version: decay


class WeightVersions(Callback):
    """Bumps versions, runs sync plans, invalidates caches, logs and checkpoints the versions."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        card = pl_module.card
        for name in sorted(pl_module.stepped):
            card.versions[name] += 1
            card.cache.invalidate(name, keep_version=card.versions[name])
            for plan in pl_module.sync_plans:
                if plan.source == name and plan.apply(card, card.versions[name]):
                    card.versions[plan.target] += 1
                    card.cache.invalidate(plan.target, keep_version=card.versions[plan.target])
        pl_module.stepped.clear()
        for name, version in card.versions.items():
            pl_module.log(f"train/version/{name}", float(version), on_step=True,
                          prog_bar=name in card.trainable)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        checkpoint["posttrain_versions"] = dict(pl_module.card.versions)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        saved = checkpoint.get("posttrain_versions", {})
        unknown = set(saved) - set(pl_module.card.versions)
        if unknown:
            raise ValueError(f"checkpoint has versions of components {sorted(unknown)} that the card lacks")
        pl_module.card.versions.update(saved)
