"""Generator rollouts and the per-step Flow-GRPO losses on them, shared by flow_grpo, joint_rl and workflows.

A rollout is ``FlowMatchSampler.sample(..., sde=True, capture=True)`` through a ``GeneratorStage`` —
the serving sampler with its SDE step switched on — so train ≡ serve. ``ppo_step_losses`` gives one
Flow-GRPO loss per trained step (PPO-clip on the recomputed log p plus the KL of the step's mean to a
frozen reference; Liu et al. 2025, METHODS.md flow_grpo), computed lazily: the method backs each one up
before the next step's forward runs, so activation memory holds one step, as in the reference
``flow_grpo/train_sd3.py``. ``c2_gap`` measures the C2 identity: at the rollout's weights the
recomputed log p equals the stored one.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import torch

from posttrain.modules.conditioning import Conditioning
from posttrain.modules.generators import GeneratorStage
from posttrain.modules.losses import ppo_clip_loss, sde_kl
from posttrain.modules.samplers import FlowMatchSampler, Trajectory


@torch.no_grad()
def rollout(stage: GeneratorStage, sampler: FlowMatchSampler, cond: Conditioning, shape: tuple[int, ...],
            generator: torch.Generator, sde: bool = True, uncond: Optional[Conditioning] = None,
            guidance_scale: Optional[float] = None, name: Optional[str] = None) -> Trajectory:
    """Sample B = ``cond.batch_size`` latents of ``shape`` (C, F', h, w) from fresh noise drawn from
    ``generator`` with component ``name`` (default: the stage's transformer), capturing every x and
    (with ``sde``) every step's log p. One batched forward per step for the whole batch (a K-sample
    group is K rows of it)."""
    noise = torch.randn((cond.batch_size, *shape), generator=generator).to(next(iter(cond.values())).device)
    return stage.sample(sampler, noise, cond, uncond, name=name, sde=sde, capture=True, generator=generator,
                        guidance_scale=guidance_scale)


def train_steps(sampler: FlowMatchSampler, fraction: float, generator: torch.Generator) -> list[int]:
    """A random ``ceil(fraction·n)`` of the n SDE steps to train on (Flow-GRPO's ``timestep_fraction``)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"timestep_fraction={fraction} must be in (0, 1]")
    sde = torch.nonzero(sampler.sde_steps()).flatten()
    k = max(1, math.ceil(fraction * len(sde)))
    chosen = sde[torch.randperm(len(sde), generator=generator)[:k]]
    return sorted(int(i) for i in chosen)


def ppo_step_losses(stage: GeneratorStage, sampler: FlowMatchSampler, traj: Trajectory, steps: list[int],
                    cond: Conditioning, advantages: torch.Tensor, clip_range: float, kl_beta: float,
                    uncond: Optional[Conditioning] = None, guidance_scale: Optional[float] = None,
                    index: Optional[torch.Tensor] = None, policy: Optional[str] = None,
                    reference: Optional[str] = None, metrics: Optional[dict[str, list[torch.Tensor]]] = None,
                    micro_batch: Optional[int] = None) -> list[Callable[[], torch.Tensor]]:
    """One zero-argument callable per step of ``steps`` returning ``(mean_b PPO-clip + kl_beta · mean_b KL)
    / len(steps)`` (``ExpertModule.step_experts`` computes and backs each up before the next).
    With ``micro_batch`` (rows per forward), one callable per step and chunk of that many rows, each returning
    its rows' share of that step's loss: the summed gradient is the same, activation memory holds one chunk.

    ``cond``/``uncond``/``advantages`` are of the whole rollout batch; ``index`` picks a minibatch.
    ``policy`` (default: the stage's transformer) carries grad; ``reference`` (a frozen role, e.g.
    ``transformer_reference``; a LoRA's is the policy with its adapter off) gives the KL's mean, without
    grad; None or ``kl_beta == 0`` skips it. ``metrics`` (if given) collects ``ratio_mean``,
    ``clip_frac``, ``approx_kl``, ``policy_loss``, ``kl`` and ``loss`` per computed step.
    """
    if not steps:
        raise ValueError("ppo_step_losses: no steps to train on")
    if traj.log_probs is None:
        raise ValueError("ppo_step_losses: the trajectory has no captured log-probs (roll out with capture=True)")
    odd = [i for i in steps if not bool(traj.sde_mask[i])]
    if odd:
        raise ValueError(f"ppo_step_losses: steps {odd} were ODE steps of the rollout; train on SDE steps only")
    rows = len(advantages) if index is None else len(index)
    chunked = micro_batch is not None and micro_batch < rows

    def step_loss(i: int, index: Optional[torch.Tensor]) -> torch.Tensor:
        cond_b = cond if index is None else cond.select(index)
        uncond_b = uncond if uncond is None or index is None else uncond.select(index)
        adv_b = (advantages if index is None else advantages[index]).float()
        ref_mean = None
        if reference is not None and kl_beta > 0:
            with torch.no_grad(), stage.velocity(reference) as ref_fn:
                ref_mean = sampler.step_log_prob(ref_fn, traj, i, cond_b, uncond_b, index, guidance_scale).mean
        with stage.velocity(policy) as fn:
            step = sampler.step_log_prob(fn, traj, i, cond_b, uncond_b, index, guidance_scale)
        old = traj.log_probs[i] if index is None else traj.log_probs[i][index]
        per_sample, step_metrics = ppo_clip_loss(step.log_prob, old, adv_b, clip_range)
        kl = torch.zeros_like(per_sample)
        if ref_mean is not None:
            std_dt = step.std * torch.sqrt(traj.sigmas[i] - traj.sigmas[i + 1]).to(step.std)
            kl = sde_kl(step.mean, ref_mean, std_dt)
        mean = per_sample.mean() + kl_beta * kl.mean()
        # a micro-batch adds its rows' share: the sum over the batch's row count instead of its own mean
        loss = (per_sample.sum() + kl_beta * kl.sum()) / (rows * len(steps)) if chunked else mean / len(steps)
        if metrics is not None:
            for key in ("ratio_mean", "clip_frac", "approx_kl"):
                metrics.setdefault(key, []).append(step_metrics[key])
            metrics.setdefault("policy_loss", []).append(per_sample.detach().mean())
            metrics.setdefault("kl", []).append(kl.detach().mean())
            metrics.setdefault("loss", []).append(mean.detach())
        return loss

    if not chunked:
        return [functools.partial(step_loss, i, index) for i in steps]
    whole = torch.arange(rows, device=advantages.device) if index is None else index
    return [functools.partial(step_loss, i, chunk) for i in steps for chunk in whole.split(micro_batch)]


@torch.no_grad()
def recompute_log_probs(stage: GeneratorStage, sampler: FlowMatchSampler, traj: Trajectory, cond: Conditioning,
                        uncond: Optional[Conditioning] = None, guidance_scale: Optional[float] = None,
                        name: Optional[str] = None) -> torch.Tensor:
    """(T, B) log p of every stored SDE step under the current weights (0 on ODE steps, as stored)."""
    out = torch.zeros_like(traj.log_probs)
    with stage.velocity(name) as fn:
        for i in torch.nonzero(traj.sde_mask).flatten().tolist():
            out[i] = sampler.step_log_prob(fn, traj, i, cond, uncond, None, guidance_scale).log_prob
    return out


def c2_gap(stage: GeneratorStage, sampler: FlowMatchSampler, traj: Trajectory, cond: Conditioning,
           uncond: Optional[Conditioning] = None, guidance_scale: Optional[float] = None,
           name: Optional[str] = None) -> torch.Tensor:
    """max |recomputed - stored log p| over the rollout's SDE steps: ~0 at the rollout's weights (C2)."""
    recomputed = recompute_log_probs(stage, sampler, traj, cond, uncond, guidance_scale, name)
    mask = traj.sde_mask.to(recomputed.device)
    if not bool(mask.any()):
        return torch.zeros(())
    return (recomputed[mask] - traj.log_probs[mask]).abs().max()


def mean_metrics(metrics: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-step metric lists (``ppo_step_losses(metrics=...)``) as their means."""
    return {key: torch.stack(values).mean() for key, values in metrics.items() if values}
