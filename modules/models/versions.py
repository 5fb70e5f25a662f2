"""Per-component weight versions and the sync plans that follow a version bump (no Lightning).

Every component of a card has an integer version (0 at load), kept on the card (``card.versions``). When an
expert's optimizer steps, ``bump`` raises its version, runs the sync plans whose source it is (EMA, the
decay-blended ``old`` policy of DiffusionNFT, a ``reference`` refresh, a rollout copy), raises each plan's
target, and drops only those components' prompt-embedding cache entries. ``callbacks.versions.WeightVersions``
calls it after every iteration, logs the versions and checkpoints them.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch

from posttrain.modules.models.cards import Routed


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
    _resolved: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)

    def pairs(self, source: torch.nn.Module, target: torch.nn.Module) -> tuple[list[tuple], int]:
        """(target, source) tensors by name, the parameters that train in the source then floating-point buffers,
        and how many are parameters; resolved once per pair of modules (not by walking both every iteration), again
        when the card holds other modules (the cache keeps them alive, so a module's identity cannot be reused).

        A parameter frozen in the source is left out: the target was copied from the source (``card.add_role``) and
        neither changes it since, so the two are equal and a blend would leave them so, bit for bit. That is a LoRA
        expert's whole base, and the float8 weights a role shares with its expert (``fp8.shared``)."""
        if self._resolved is None or self._resolved[0] is not source or self._resolved[1] is not target:
            src = dict(source.named_parameters())
            pairs = [(p, src[name]) for name, p in target.named_parameters() if src[name].requires_grad]
            params = len(pairs)
            src_buffers = dict(source.named_buffers())
            pairs += [(b, src_buffers[name]) for name, b in target.named_buffers() if b.is_floating_point()]
            self._resolved = (source, target, pairs, params)
        return self._resolved[2], self._resolved[3]

    @torch.no_grad()
    def apply(self, card, source_version: int) -> bool:
        if source_version % self.every:
            return False
        d = float(self.decay(source_version))
        pairs, params = self.pairs(_model(card[self.source]), _model(card[self.target]))
        with _gathered([s for _, s in pairs[:params]]), _gathered([t for t, _ in pairs[:params]], modifier=True):
            # one fused lerp over all tensors (torch._foreach, as torch.optim does): a loop of per-tensor
            # lerp_ calls cost twice as much on a small model, where the sync runs every iteration
            if pairs:
                torch._foreach_lerp_([t for t, _ in pairs], [s if s.dtype == t.dtype else s.to(t.dtype)
                                                             for t, s in pairs], 1.0 - d)
        return True


def _model(module) -> torch.nn.Module:
    """The model itself for a routed expert (a fresh ``Routed`` stand-in comes with every ``card[name]``)."""
    return module.model if type(module) is Routed else module


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


def bump(card, stepped: Iterable[str], plans: list[SyncPlan]) -> None:
    """Raise the version of every expert in ``stepped``, then run the plans whose source it is (raising their
    targets); every raised component's cached prompt rows of older versions are dropped."""
    for name in sorted(stepped):
        card.versions[name] += 1
        card.cache.invalidate(name, keep_version=card.versions[name])
        for plan in plans:
            if plan.source == name and plan.apply(card, card.versions[name]):
                card.versions[plan.target] += 1
                card.cache.invalidate(plan.target, keep_version=card.versions[plan.target])
