"""Losses: tensors in, per-sample losses (B,) and metrics out; the method picks the reduction."""
from __future__ import annotations

import torch

from posttrain.modules.samplers import shift_sigmas


def sample_sigmas(batch_size: int, mode: str, rng: torch.Generator | None = None, shift: float = 1.0,
                  logit_mean: float = 0.0, logit_std: float = 1.0, low: float = 0.0, high: float = 1.0
                  ) -> torch.Tensor:
    """(B,) training σ: uniform, or logit-normal as in SD3/Wan training, mapped onto [low, high] (DMD2 draws
    its score σ from [0.02, 0.98]); then flow-shifted."""
    if mode == "uniform":
        sigma = torch.rand(batch_size, generator=rng)
    elif mode == "logit_normal":
        sigma = torch.sigmoid(logit_mean + logit_std * torch.randn(batch_size, generator=rng))
    else:
        raise ValueError(f"unknown sigma sampling {mode!r}; choose 'uniform' or 'logit_normal'")
    if (low, high) != (0.0, 1.0):
        sigma = low + (high - low) * sigma
    return shift_sigmas(sigma, shift)


def flow_matching_loss(v_pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Per-sample MSE(v_θ(x_σ, σ, c), ε - x0), the rectified-flow target (METHODS.md, finetune)."""
    err = (v_pred.float() - (noise - x0).float()) ** 2
    per_sample = err.mean(dim=tuple(range(1, err.ndim)))
    return per_sample, {"v_target_norm": (noise - x0).float().pow(2).mean().sqrt().detach()}


def noised(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """x_σ = (1-σ)·x0 + σ·ε with σ (B,)."""
    s = sigma.view(-1, *([1] * (x0.ndim - 1))).to(x0)
    return (1 - s) * x0 + s * noise


# ---------------------------------------------------------------------------------------- RL losses
def ppo_clip_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                  clip_range: float) -> tuple[torch.Tensor, dict]:
    """Per-sample PPO-clip loss ``max(-A·ratio, -A·clip(ratio, 1-ε, 1+ε))``, ``ratio = exp(lp - lp_old)``
    (Schulman et al. 2017; Flow-GRPO, METHODS.md flow_grpo). All inputs (B,); ``old_log_prob`` is
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
    """Per-sample DiffusionNFT loss (Zheng et al. 2025, "DiffusionNFT"; METHODS.md diffusion_nft).

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


# ------------------------------------------------------------------------------------ distillation losses
def x0_from_velocity(x_t: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """x̂0 = x_σ - σ·v (flow matching, v ≈ ε - x0); ``sigma`` (B,), tensors (B, C, F, H, W). Guidance commutes with
    it: x0_u + g·(x0_c - x0_u) = x_σ - σ·(v_u + g·(v_c - v_u)), so CFG in x0 space is CFG on the velocities."""
    s = sigma.float().reshape(-1, *([1] * (x_t.ndim - 1))).to(x_t.device)
    return x_t.float() - s * v.float()


def dmd_generator_loss(x0: torch.Tensor, real_x0_cond: torch.Tensor, fake_x0: torch.Tensor,
                       real_x0_uncond: torch.Tensor | None = None, guidance_scale: float = 1.0
                       ) -> tuple[torch.Tensor, dict]:
    """Per-sample DMD2 generator loss (Yin et al. 2024, "Improved Distribution Matching Distillation", eq. 2 with
    DMD's normalized gradient, eq. 7–8; METHODS.md dmd2; reference Self-Forcing ``model/dmd.py``,
    ``_compute_kl_grad`` and ``compute_distribution_matching_loss``).

    ``x0`` is the student's sample x̂0 (with gradient); the three scores are x0 predictions at the same noised
    x_σ = (1-σ)·x̂0 + σ·ε, treated as constants:
    ``real = real_u + g·(real_c - real_u)`` (teacher CFG; no CFG without ``real_x0_uncond``), ``fake`` = the
    critic's x0 (no CFG). Then per sample ``grad = (fake - real) / mean|x̂0 - real|``, ``nan_to_num``, and
    ``L_G = 0.5·mean((x̂0 - sg(x̂0 - grad))²)``, whose gradient is ``grad / n`` (n elements per sample): it pushes
    x̂0 away from the critic's (fake) and towards the teacher's (real) denoising. Computed in float64 like the
    reference, so that x̂0 - (x̂0 - grad) keeps a small grad exact. Shapes (B, C, F, H, W) or any (B, ...).
    The guidance convention is METHODS.md's: Self-Forcing's ``cond + g'·(cond - uncond)`` is g = g' + 1 here.
    The critic's own loss is ``flow_matching_loss`` on the detached samples (target ε - sg(x̂0)).

    Metrics: ``dmd_grad_abs`` mean |grad| (the reference's ``dmdtrain_gradient_norm``), ``dmd_normalizer`` mean of
    the per-sample mean|x̂0 - real|.
    """
    if real_x0_uncond is None and guidance_scale != 1.0:
        raise ValueError(f"guidance_scale={guidance_scale} needs the teacher's unconditional x0 (real_x0_uncond)")
    dims = tuple(range(1, x0.ndim))
    with torch.no_grad():
        real = real_x0_cond.double()
        if real_x0_uncond is not None:
            real = real_x0_uncond.double() + guidance_scale * (real - real_x0_uncond.double())
        normalizer = (x0.detach().double() - real).abs().mean(dim=dims, keepdim=True)
        grad = torch.nan_to_num((fake_x0.double() - real) / normalizer)
        target = x0.detach().double() - grad
    per_sample = 0.5 * (x0.double() - target).pow(2).mean(dim=dims)
    metrics = {"dmd_grad_abs": grad.abs().mean().float(), "dmd_normalizer": normalizer.mean().float()}
    return per_sample.float(), metrics


def gan_critic_loss(real_logits: torch.Tensor, fake_logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Per-sample DMD2 GAN loss of the critic's classifier (Yin et al. 2024, §4.2; reference ``sd_guidance.py``,
    ``compute_guidance_clean_cls_loss``): ``softplus(fake) + softplus(-real)``, the logistic loss of telling real
    (teacher) samples, logit → +∞, from fake (student) ones, logit → -∞. Logits (B,) each, row i of one against
    row i of the other. At logits 0 both terms are log 2. Metrics: mean sigmoid of each (the head's accuracy
    proxy: real → 1, fake → 0)."""
    per_sample = torch.nn.functional.softplus(fake_logits.float()) + torch.nn.functional.softplus(-real_logits.float())
    metrics = {"gan_real_prob": torch.sigmoid(real_logits.detach()).mean(),
               "gan_fake_prob": torch.sigmoid(fake_logits.detach()).mean()}
    return per_sample, metrics


def gan_generator_loss(fake_logits: torch.Tensor) -> torch.Tensor:
    """Per-sample non-saturating generator loss ``softplus(-fake)`` = -log sigmoid(fake) (Goodfellow et al. 2014;
    DMD2 ``compute_generator_clean_cls_loss``), (B,) logits of the student's samples by the frozen critic's head."""
    return torch.nn.functional.softplus(-fake_logits.float())
