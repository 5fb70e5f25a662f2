"""Flow-matching losses and the σ they are trained at: tensors in, per-sample values (B,) and metrics out; the
method picks the reduction."""
from __future__ import annotations

import torch

from posttrain.modules.flow.samplers import shift_sigmas


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
    """Per-sample MSE(v_θ(x_σ, σ, c), ε - x0), the rectified-flow target (docs/methods.md#finetune)."""
    err = (v_pred.float() - (noise - x0).float()) ** 2
    per_sample = err.mean(dim=tuple(range(1, err.ndim)))
    return per_sample, {"v_target_norm": (noise - x0).float().pow(2).mean().sqrt().detach()}


def noised(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """x_σ = (1-σ)·x0 + σ·ε with σ (B,)."""
    s = sigma.view(-1, *([1] * (x0.ndim - 1))).to(x0)
    return (1 - s) * x0 + s * noise


def x0_from_velocity(x_t: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """x̂0 = x_σ - σ·v (flow matching, v ≈ ε - x0); ``sigma`` (B,), tensors (B, C, F, H, W). Guidance commutes with
    it: x0_u + g·(x0_c - x0_u) = x_σ - σ·(v_u + g·(v_c - v_u)), so CFG in x0 space is CFG on the velocities."""
    s = sigma.float().reshape(-1, *([1] * (x_t.ndim - 1))).to(x_t.device)
    return x_t.float() - s * v.float()
