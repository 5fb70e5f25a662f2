"""The RL losses (FlowGRPO's clipped ratio and KL, DiffusionNFT's implicit policy loss): tensors in, per-sample
losses (B,) and metrics out; the method picks the reduction."""
from __future__ import annotations

import torch


def ppo_clip_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                  clip_range: float) -> tuple[torch.Tensor, dict]:
    """Per-sample PPO-clip loss ``max(-A·ratio, -A·clip(ratio, 1-ε, 1+ε))``, ``ratio = exp(lp - lp_old)``
    (Schulman et al. 2017; Flow-GRPO, docs/methods.md#flow-grpo). All inputs (B,); ``old_log_prob`` is
    treated as a constant. Metrics: ``ratio_mean``, ``clip_frac`` (share with |ratio-1| > ε),
    ``approx_kl`` (mean ½(lp - lp_old)²)."""
    if clip_range <= 0:
        raise ValueError(f"clip_range={clip_range} must be > 0 (PPO's ε; the default is 1e-3)")
    diff = log_prob.float() - old_log_prob.detach().float()
    ratio = torch.exp(diff)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    per_sample = torch.maximum(unclipped, clipped)
    metrics = {
        "ratio_mean": ratio.detach().mean(),
        "clip_frac": ((ratio.detach() - 1.0).abs() > clip_range).float().mean(),
        "approx_kl": 0.5 * diff.detach().pow(2).mean(),
    }
    return per_sample, metrics


def sde_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std_dt: torch.Tensor) -> torch.Tensor:
    """Per-sample KL between two SDE transitions of equal variance: mean over non-batch dims of
    ``(mean_θ - mean_ref)² / (2·std_dt²)``, ``std_dt = std·sqrt(-dt)`` (Flow-GRPO's KL to the
    reference). Carries gradient through ``mean``; ``ref_mean`` and ``std_dt`` are constants."""
    std_dt = std_dt.detach().float().to(mean.device)
    std_dt = std_dt.reshape(-1, *([1] * (mean.ndim - 1))) if std_dt.ndim else std_dt
    kl = (mean.float() - ref_mean.detach().float()) ** 2 / (2 * std_dt**2)
    return kl.mean(dim=tuple(range(1, kl.ndim)))


def nft_reward_weight(advantages: torch.Tensor, clip: float = 5.0) -> torch.Tensor:
    """DiffusionNFT's optimality probability ``r = clip(clip(A, ±c)/c/2 + 0.5, 0, 1)`` in [0, 1]."""
    return (advantages.clamp(-clip, clip) / clip / 2 + 0.5).clamp(0.0, 1.0)


def nft_loss(v_theta: torch.Tensor, v_old: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor,
             sigma: torch.Tensor, r: torch.Tensor, beta: float = 1.0, v_ref: torch.Tensor | None = None,
             kl_beta: float = 0.0, adv_clip: float = 5.0) -> tuple[torch.Tensor, dict]:
    """Per-sample DiffusionNFT loss (Zheng et al. 2025, "DiffusionNFT"; docs/methods.md#diffusion-nft).

    ``v+ = β·v_θ + (1-β)·v_old`` (implicit positive policy), ``v- = (1+β)·v_old - β·v_θ`` (implicit
    negative), ``x0± = x_t - σ·v±``, ``L± = mean((x0± - x0)²) / sg(max(mean|x0± - x0|, 1e-5))``;
    ``loss = adv_clip·(r·L+/β + (1-r)·L-/β) + kl_β·mean((v_θ - v_ref)²)``.
    Shapes: velocities, ``x_t``, ``x0`` (B, ...); ``sigma``, ``r`` (B,). ``v_old``/``v_ref`` are constants.
    """
    if beta <= 0:
        raise ValueError(f"beta={beta} must be > 0")
    dims = tuple(range(1, v_theta.ndim))
    s = sigma.float().reshape(-1, *([1] * (v_theta.ndim - 1))).to(v_theta.device)
    v_theta, v_old, x_t, x0 = v_theta.float(), v_old.detach().float(), x_t.float(), x0.float()
    v_pos = beta * v_theta + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v_theta
    err_pos = x_t - s * v_pos - x0
    err_neg = x_t - s * v_neg - x0
    l_pos = err_pos.pow(2).mean(dims) / err_pos.detach().abs().mean(dims).clamp(min=1e-5)
    l_neg = err_neg.pow(2).mean(dims) / err_neg.detach().abs().mean(dims).clamp(min=1e-5)
    policy = adv_clip * (r * l_pos / beta + (1 - r) * l_neg / beta)
    kl = torch.zeros_like(policy)
    if v_ref is not None and kl_beta > 0:
        kl = (v_theta - v_ref.detach().float()).pow(2).mean(dims)
    per_sample = policy + kl_beta * kl
    metrics = {"policy_loss": policy.detach().mean(), "kl": kl.detach().mean(),
               "positive_loss": l_pos.detach().mean(), "negative_loss": l_neg.detach().mean()}
    return per_sample, metrics


def nft_old_decay(decay_type: int, step: int) -> float:
    """DiffusionNFT's decay η of ``θ_old ← η·θ_old + (1-η)·θ`` after the policy's ``step``-th update:
    type 0: 0 (old = current); type 1: min(0.001·step, 0.5); type 2: 0 below step 75, then
    min(0.0075·(step - 75), 0.999)."""
    if decay_type == 0:
        return 0.0
    if decay_type == 1:
        return min(0.001 * step, 0.5)
    if decay_type == 2:
        return 0.0 if step < 75 else min(0.0075 * (step - 75), 0.999)
    raise ValueError(f"decay_type={decay_type}; choose 0, 1 or 2")
