"""Generator rollouts and the per-step Flow-GRPO losses on them, shared by flow_grpo, joint_rl and workflow_rl.

A ``Rollout`` is what travels together from sampling to the update: the generator stage that ran it, the
sampler it ran with (its σ grid, SDE noise level and CFG scale: the recompute must use the same), the
trajectory (x of every step, log p of every SDE step) and the conditioning of its rows. It is sampled by
``Rollout.sample`` — ``FlowMatchSampler.sample(..., sde=True, capture=True)`` through the stage, the serving
loop with its SDE step switched on — so train ≡ serve. ``Rollout.step_losses`` gives one Flow-GRPO loss per
trained step (PPO-clip on the recomputed log p plus the KL of the step's mean to a frozen reference; Liu et al.
2025, docs/methods.md#flow-grpo), computed lazily: the method backs each one up before the next step's forward runs,
so activation memory holds one step, as in the reference ``flow_grpo/train_sd3.py``. ``Rollout.logprob_gap``
measures log-probability parity: at the rollout's weights the recomputed log p equals the stored one.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from posttrain.modules.flow.conditioning import Conditioning
from posttrain.modules.models.generators import GeneratorStage
from posttrain.modules.rl.losses import ppo_clip_loss, sde_kl
from posttrain.modules.flow.samplers import FlowMatchSampler, SDEStep, Trajectory


@dataclass
class Rollout:
    """B rows of one generator rollout and what recomputing them needs.

    Args:
        stage: the generator stage that rolled out (its adapter runs every recompute).
        sampler: the sampler it rolled out with (σ grid, noise level, CFG scale).
        traj: the captured trajectory of all the rollout's rows (``xs`` (T + 1, N, ...), ``log_probs`` (T, N)).
        cond, uncond: the conditioning of this rollout's B rows (``uncond`` with CFG, else None).
        rows: (B,) which of the trajectory's N rows this rollout holds (``select``); None = all.
    """

    stage: GeneratorStage
    sampler: FlowMatchSampler
    traj: Trajectory
    cond: Conditioning
    uncond: Optional[Conditioning] = None
    rows: Optional[torch.Tensor] = None

    @classmethod
    @torch.no_grad()
    def sample(cls, stage: GeneratorStage, sampler: FlowMatchSampler, cond: Conditioning,
               uncond: Optional[Conditioning], shape: tuple[int, ...], rng: torch.Generator, sde: bool = True,
               name: Optional[str] = None, noise: Optional[torch.Tensor] = None) -> "Rollout":
        """Sample B = ``cond.batch_size`` latents of ``shape`` (C, F', h, w) from fresh noise drawn from ``rng``
        (or from the given ``noise`` (B, C, F', h, w), e.g. one draw shared by a group's K rows) with component
        ``name`` (default: the stage's transformer), capturing every x and (with ``sde``) every step's log p. One
        batched forward per step for the whole batch (a K-sample group is K rows of it)."""
        if noise is None:
            noise = torch.randn((cond.batch_size, *shape), generator=rng)
        noise = noise.to(next(iter(cond.values())).device)
        traj = stage.sample(sampler, noise, cond, uncond, name=name, sde=sde, capture=True, rng=rng)
        return cls(stage, sampler, traj, cond, uncond)

    @property
    def latents(self) -> torch.Tensor:
        """(B, C, F', h, w) the clean samples."""
        return self.traj.latents if self.rows is None else self.traj.latents[self.rows]

    def select(self, index: torch.Tensor) -> "Rollout":
        """The rows ``index`` ((M,) long, positions in this rollout) as a rollout of M rows."""
        uncond = None if self.uncond is None else self.uncond.select(index)
        rows = index if self.rows is None else self.rows[index]
        return dataclasses.replace(self, cond=self.cond.select(index), uncond=uncond, rows=rows)

    def step_log_prob(self, i: int, name: Optional[str] = None) -> SDEStep:
        """Step ``i`` of these rows recomputed under component ``name``'s current weights (with grad)."""
        with self.stage.velocity(name) as fn:
            return self.sampler.step_log_prob(fn, self.traj, i, self.cond, self.uncond, self.rows)

    def step_losses(self, steps: list[int], advantages: torch.Tensor, clip_range: float, kl_beta: float,
                    reference: Optional[str] = None, micro_batch: Optional[int] = None,
                    metrics: Optional[dict[str, list[torch.Tensor]]] = None) -> list[Callable[[], torch.Tensor]]:
        """One zero-argument callable per step of ``steps`` returning ``(mean_b PPO-clip + kl_beta · mean_b KL)
        / len(steps)`` over these rows (``ExpertModule.step_experts`` computes and backs each up before the next).
        With ``micro_batch`` (rows per forward), one callable per step and chunk of that many rows, each returning
        its rows' share of that step's loss: the summed gradient is the same, activation memory holds one chunk.

        ``advantages`` (B,) are of these rows. The policy (the stage's transformer) carries grad; ``reference``
        (a frozen role, e.g. ``transformer_reference``; a LoRA's is the policy with its adapter off) gives the
        KL's mean, without grad; None or ``kl_beta == 0`` skips it. ``metrics`` (if given) collects
        ``ppo_ratio_mean``, ``clip_frac``, ``approx_kl``, ``policy_loss``, ``kl`` and ``loss`` per computed step.
        """
        if not steps:
            raise ValueError("step_losses: no steps to train on")
        if self.traj.log_probs is None:
            raise ValueError("step_losses: the trajectory has no captured log-probs (roll out with capture=True)")
        odd = [i for i in steps if not bool(self.traj.sde_mask[i])]
        if odd:
            raise ValueError(f"step_losses: steps {odd} were ODE steps of the rollout; train on SDE steps only")
        rows = len(advantages)
        chunked = micro_batch is not None and micro_batch < rows

        def step_loss(i: int, part: Rollout, adv: torch.Tensor) -> torch.Tensor:
            adv = adv.float()
            ref_mean = None
            if reference is not None and kl_beta > 0:
                with torch.no_grad():
                    ref_mean = part.step_log_prob(i, reference).mean
            step = part.step_log_prob(i)
            old = part.traj.log_probs[i] if part.rows is None else part.traj.log_probs[i][part.rows]
            per_sample, step_metrics = ppo_clip_loss(step.log_prob, old, adv, clip_range)
            kl = torch.zeros_like(per_sample)
            if ref_mean is not None:
                std_dt = step.std * torch.sqrt(part.traj.sigmas[i] - part.traj.sigmas[i + 1]).to(step.std)
                kl = sde_kl(step.mean, ref_mean, std_dt)
            mean = per_sample.mean() + kl_beta * kl.mean()
            # a micro-batch adds its rows' share: the sum over the batch's row count instead of its own mean
            loss = (per_sample.sum() + kl_beta * kl.sum()) / (rows * len(steps)) if chunked else mean / len(steps)
            if metrics is not None:
                metrics.setdefault("ppo_ratio_mean", []).append(step_metrics["ratio_mean"])
                for key in ("clip_frac", "approx_kl"):
                    metrics.setdefault(key, []).append(step_metrics[key])
                metrics.setdefault("policy_loss", []).append(per_sample.detach().mean())
                metrics.setdefault("kl", []).append(kl.detach().mean())
                metrics.setdefault("loss", []).append(mean.detach())
            return loss

        if not chunked:
            return [functools.partial(step_loss, i, self, advantages) for i in steps]
        chunks = torch.arange(rows, device=advantages.device).split(micro_batch)
        return [functools.partial(step_loss, i, self.select(chunk), advantages[chunk]) for i in steps
                for chunk in chunks]

    @torch.no_grad()
    def recompute_log_probs(self, name: Optional[str] = None) -> torch.Tensor:
        """(T, B) log p of every stored SDE step under component ``name``'s current weights (0 on ODE steps)."""
        out = torch.zeros_like(self.traj.log_probs if self.rows is None else self.traj.log_probs[:, self.rows])
        with self.stage.velocity(name) as fn:
            for i in torch.nonzero(self.traj.sde_mask).flatten().tolist():
                out[i] = self.sampler.step_log_prob(fn, self.traj, i, self.cond, self.uncond, self.rows).log_prob
        return out

    def logprob_gap(self, name: Optional[str] = None) -> torch.Tensor:
        """max |recomputed - stored log p| over the rollout's SDE steps: ~0 at the rollout's weights (log-probability parity)."""
        recomputed = self.recompute_log_probs(name)
        stored = self.traj.log_probs if self.rows is None else self.traj.log_probs[:, self.rows]
        mask = self.traj.sde_mask.to(recomputed.device)
        if not bool(mask.any()):
            return torch.zeros(())
        return (recomputed[mask] - stored[mask]).abs().max()


def train_steps(sampler: FlowMatchSampler, fraction: float, rng: torch.Generator,
                among: Optional[list[int]] = None) -> list[int]:
    """A random ``ceil(fraction·n)`` of the n SDE steps to train on (Flow-GRPO's ``timestep_fraction``); ``among``:
    the n steps to choose from (a pair of noise experts: the steps of the experts that train), None = all SDE steps."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"timestep_fraction={fraction} must be in (0, 1]")
    sde = torch.nonzero(sampler.sde_steps()).flatten() if among is None else torch.tensor(among, dtype=torch.long)
    k = max(1, math.ceil(fraction * len(sde)))
    chosen = sde[torch.randperm(len(sde), generator=rng)[:k]]
    return sorted(int(i) for i in chosen)


def mean_metrics(metrics: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-step metric lists (``Rollout.step_losses(metrics=...)``) as their means."""
    return {key: torch.stack(values).mean() for key, values in metrics.items() if values}
