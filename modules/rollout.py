"""Generator rollouts and the Flow-GRPO policy loss on them, shared by flow_grpo and joint_rl.

A rollout is ``FlowMatchSampler.sample(..., sde=True, capture=True)`` — the serving sampler with its
SDE step switched on — so train ≡ serve. ``ppo_step_loss`` recomputes chosen steps' log p under the
current weights (``FlowMatchSampler.step_log_prob``) and returns the PPO-clip loss plus the KL of the
step's mean to a frozen reference (Flow-GRPO, Liu et al. 2025; METHODS.md flow_grpo). ``c2_gap``
measures the C2 identity: at the rollout's weights the recomputed log p equals the stored one.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager, Optional, Union

import torch
from torch import nn

from posttrain.modules.losses import ppo_clip_loss, sde_kl
from posttrain.modules.samplers import FlowMatchSampler, Trajectory, wan_velocity

# A model to run: a module, or a zero-argument callable returning a context manager that yields the
# module (``lambda: card.use("transformer_reference")``: a LoRA reference is the policy with its adapter
# switched off only inside the context).
ModelRef = Union[nn.Module, Callable[[], ContextManager[nn.Module]]]


@contextlib.contextmanager
def velocity_of(model: ModelRef):
    """Yield the velocity function of ``model`` (see ``ModelRef``), entering its context if it has one."""
    if isinstance(model, nn.Module):
        yield wan_velocity(model)
    else:
        with model() as module:
            yield wan_velocity(module)


@torch.no_grad()
def rollout(sampler: FlowMatchSampler, transformer: ModelRef, cond: torch.Tensor, shape: tuple[int, ...],
            generator: torch.Generator, sde: bool = True, uncond: Optional[torch.Tensor] = None,
            guidance_scale: Optional[float] = None) -> Trajectory:
    """Sample B = ``cond.shape[0]`` latents of ``shape`` (C, F', h, w) from fresh noise drawn from
    ``generator``, capturing every x and (with ``sde``) every step's log p. One batched forward per
    step for the whole batch (a K-sample group is K rows of it)."""
    noise = torch.randn((cond.shape[0], *shape), generator=generator).to(cond.device)
    with velocity_of(transformer) as fn:
        return sampler.sample(fn, noise, cond, uncond, sde=sde, capture=True, generator=generator,
                              guidance_scale=guidance_scale)


def train_steps(sampler: FlowMatchSampler, fraction: float, generator: torch.Generator) -> list[int]:
    """A random ``ceil(fraction·n)`` of the n SDE steps to train on (Flow-GRPO's ``timestep_fraction``)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"timestep_fraction={fraction} must be in (0, 1]")
    sde = torch.nonzero(sampler.sde_steps()).flatten()
    k = max(1, math.ceil(fraction * len(sde)))
    chosen = sde[torch.randperm(len(sde), generator=generator)[:k]]
    return sorted(int(i) for i in chosen)


def ppo_step_loss(sampler: FlowMatchSampler, transformer: ModelRef, reference: Optional[ModelRef],
                  traj: Trajectory, steps: list[int], cond: torch.Tensor, advantages: torch.Tensor,
                  clip_range: float, kl_beta: float, uncond: Optional[torch.Tensor] = None,
                  guidance_scale: Optional[float] = None,
                  index: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scalar Flow-GRPO loss, averaged over ``steps``: ``mean_b PPO-clip + kl_beta · mean_b KL(ref)``.

    ``cond``/``uncond``/``advantages`` are of the whole rollout batch; ``index`` picks a minibatch.
    The reference mean is computed first, without grad (a LoRA reference switches the policy's adapter
    off only for that pass); the policy's log p and mean carry grad. With ``kl_beta == 0`` or no
    ``reference`` the KL is not computed. Metrics: ``ratio_mean``, ``clip_frac``, ``approx_kl``,
    ``policy_loss``, ``kl`` (means over steps).
    """
    if not steps:
        raise ValueError("ppo_step_loss: no steps to train on")
    if traj.log_probs is None:
        raise ValueError("ppo_step_loss: the trajectory has no captured log-probs (roll out with capture=True)")
    sel = (lambda t: t) if index is None else (lambda t: t[index])
    cond_b, adv_b = sel(cond), sel(advantages).float()
    uncond_b = None if uncond is None else sel(uncond)
    totals: dict[str, list[torch.Tensor]] = {"ratio_mean": [], "clip_frac": [], "approx_kl": [], "policy_loss": [],
                                             "kl": []}
    loss = torch.zeros((), device=cond.device)
    for i in steps:
        if not bool(traj.sde_mask[i]):
            raise ValueError(f"ppo_step_loss: step {i} was an ODE step of the rollout; train on SDE steps only")
        kl = torch.zeros(adv_b.shape[0], device=cond.device)
        ref_mean = None
        if reference is not None and kl_beta > 0:
            with torch.no_grad(), velocity_of(reference) as ref_fn:
                ref_mean = sampler.step_log_prob(ref_fn, traj, i, cond_b, uncond_b, index, guidance_scale).mean
        with velocity_of(transformer) as fn:
            step = sampler.step_log_prob(fn, traj, i, cond_b, uncond_b, index, guidance_scale)
        old = sel(traj.log_probs[i])
        per_sample, metrics = ppo_clip_loss(step.log_prob, old, adv_b, clip_range)
        if ref_mean is not None:
            std_dt = step.std * torch.sqrt(traj.sigmas[i] - traj.sigmas[i + 1]).to(step.std)
            kl = sde_kl(step.mean, ref_mean, std_dt)
        loss = loss + (per_sample.mean() + kl_beta * kl.mean()) / len(steps)
        for k in ("ratio_mean", "clip_frac", "approx_kl"):
            totals[k].append(metrics[k])
        totals["policy_loss"].append(per_sample.detach().mean())
        totals["kl"].append(kl.detach().mean())
    return loss, {k: torch.stack(v).mean() for k, v in totals.items()}


@torch.no_grad()
def recompute_log_probs(sampler: FlowMatchSampler, transformer: ModelRef, traj: Trajectory, cond: torch.Tensor,
                        uncond: Optional[torch.Tensor] = None,
                        guidance_scale: Optional[float] = None) -> torch.Tensor:
    """(T, B) log p of every stored SDE step under the current weights (0 on ODE steps, as stored)."""
    out = torch.zeros_like(traj.log_probs)
    with velocity_of(transformer) as fn:
        for i in torch.nonzero(traj.sde_mask).flatten().tolist():
            out[i] = sampler.step_log_prob(fn, traj, i, cond, uncond, None, guidance_scale).log_prob
    return out


def c2_gap(sampler: FlowMatchSampler, transformer: ModelRef, traj: Trajectory, cond: torch.Tensor,
           uncond: Optional[torch.Tensor] = None, guidance_scale: Optional[float] = None) -> torch.Tensor:
    """max |recomputed - stored log p| over the rollout's SDE steps: ~0 at the rollout's weights (C2)."""
    recomputed = recompute_log_probs(sampler, transformer, traj, cond, uncond, guidance_scale)
    mask = traj.sde_mask.to(recomputed.device)
    if not bool(mask.any()):
        return torch.zeros(())
    return (recomputed[mask] - traj.log_probs[mask]).abs().max()
