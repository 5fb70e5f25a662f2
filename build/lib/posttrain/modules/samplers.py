"""The one flow-matching sampler: serving (ODE Euler, CFG) and RL rollouts (FlowGRPO SDE, log p).

Flow matching with ``x_σ = (1-σ)·x0 + σ·ε`` and velocity ``v ≈ ε - x0``; σ runs 1 → 0 over a
flow-shifted schedule ``σ' = s·σ / (1 + (s-1)·σ)``. ``predict``, sample logging and every rollout go
through ``FlowMatchSampler.sample``; the SDE step (Flow-GRPO, Liu et al. 2025, eq. 9–12, reference
``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``) is switched on per call, never by default.
Everything numeric here runs in float32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# (x (B, C, F, H, W), sigma (B,), conditioning) -> velocity, same shape as x
VelocityFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """Flow shift used by Wan/FLUX/SD3: σ' = s·σ / (1 + (s-1)·σ)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def sigma_schedule(num_steps: int, shift: float = 1.0) -> torch.Tensor:
    """(num_steps + 1,) float32 σ from 1 to 0, shifted."""
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps} must be >= 1")
    return shift_sigmas(torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64), shift).float()


def _bcast(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) or () -> (B, 1, 1, ...) to broadcast against ``like``."""
    t = t.to(device=like.device, dtype=torch.float32)
    return t.reshape(-1, *([1] * (like.ndim - 1))) if t.ndim else t


def sde_std(sigma: torch.Tensor, noise_level: float, sigma_cap: float) -> torch.Tensor:
    """``a·sqrt(σ/(1-σ))``; at σ = 1 the denominator uses ``sigma_cap``, the first σ below 1 (Flow-GRPO)."""
    sigma = sigma.float()
    denom = 1 - torch.where(sigma >= 1, torch.full_like(sigma, sigma_cap), sigma)
    return noise_level * torch.sqrt(sigma / denom)


def sde_mean(x: torch.Tensor, v: torch.Tensor, sigma, sigma_next, std) -> torch.Tensor:
    """mean = x·(1 + std²·dt/(2σ)) + v·(1 + std²·(1-σ)/(2σ))·dt, dt = σ_next - σ < 0."""
    s, s_next, std = _bcast(sigma, x), _bcast(sigma_next, x), _bcast(std, x)
    dt = s_next - s
    return x.float() * (1 + std**2 * dt / (2 * s)) + v.float() * (1 + std**2 * (1 - s) / (2 * s)) * dt


def gaussian_log_prob(x_next: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(B,) mean over non-batch dims of log N(x_next; mean, scale²), with ``scale`` = std·sqrt(-dt)."""
    scale = _bcast(scale, mean)
    lp = -((x_next.float() - mean) ** 2) / (2 * scale**2) - torch.log(scale) - 0.5 * math.log(2 * math.pi)
    return lp.mean(dim=tuple(range(1, lp.ndim)))


@dataclass
class SDEStep:
    x_next: torch.Tensor  # (B, ...)
    log_prob: torch.Tensor  # (B,)
    mean: torch.Tensor  # (B, ...)
    std: torch.Tensor  # (B,) or (): the σ-level std, before sqrt(-dt)


def sde_step(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor, noise_level: float,
             sigma_cap: float, x_next: Optional[torch.Tensor] = None,
             generator: Optional[torch.Generator] = None) -> SDEStep:
    """One Flow-GRPO SDE step. With ``x_next`` given, only its log-probability is computed (PPO recompute)."""
    sigma = sigma.float().to(x.device)
    sigma_next = sigma_next.float().to(x.device)
    std = sde_std(sigma, noise_level, sigma_cap)
    mean = sde_mean(x, v, sigma, sigma_next, std)
    scale = std * torch.sqrt(sigma - sigma_next)
    if x_next is None:
        noise = torch.randn(mean.shape, generator=generator, device="cpu" if generator is None else generator.device)
        x_next = mean + _bcast(scale, mean) * noise.to(mean.device)
    return SDEStep(x_next=x_next, log_prob=gaussian_log_prob(x_next, mean, scale), mean=mean, std=std)


def ml_velocity(x: torch.Tensor, x_next: torch.Tensor, sigma, sigma_next, noise_level: float,
                sigma_cap: float) -> torch.Tensor:
    """The velocity whose SDE mean lands exactly on ``x_next``: v* = (x_next - x·A) / B."""
    s, s_next = _bcast(torch.as_tensor(sigma), x), _bcast(torch.as_tensor(sigma_next), x)
    std = sde_std(s, noise_level, sigma_cap)
    dt = s_next - s
    a = 1 + std**2 * dt / (2 * s)
    b = (1 + std**2 * (1 - s) / (2 * s)) * dt
    return (x_next.float() - x.float() * a) / b


def guided(v_cond: torch.Tensor, v_uncond: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """Classifier-free guidance: v = v_u + g·(v_c - v_u)."""
    if v_uncond is None or scale == 1.0:
        return v_cond
    return v_uncond + scale * (v_cond - v_uncond)


@dataclass
class Trajectory:
    """A sampled batch. ``xs``/``log_probs`` are filled when the rollout captured them."""

    latents: torch.Tensor  # (B, C, F, H, W) clean sample at σ = 0
    sigmas: torch.Tensor  # (T + 1,)
    xs: Optional[torch.Tensor] = None  # (T + 1, B, ...) x at each σ, xs[0] the noise
    log_probs: Optional[torch.Tensor] = None  # (T, B) log p of each SDE step (0 for ODE steps)
    sde_mask: Optional[torch.Tensor] = None  # (T,) bool, which steps were stochastic


class FlowMatchSampler:
    """Euler sampler over a shifted σ schedule, ODE by default, Flow-GRPO SDE on request.

    Args:
        num_steps: denoising steps.
        shift: flow shift of the σ schedule.
        guidance_scale: classifier-free guidance; 1 disables the unconditional pass.
        noise_level: the SDE's ``a`` (Flow-GRPO anchor 0.7).
        sde_window: ``(start, end)`` step indices that are stochastic in an SDE rollout; None = all.
    """

    def __init__(self, num_steps: int = 20, shift: float = 3.0, guidance_scale: float = 1.0,
                 noise_level: float = 0.7, sde_window: Optional[tuple[int, int]] = None):
        if num_steps < 1:
            raise ValueError(f"num_steps={num_steps} must be >= 1")
        if sde_window is not None and not (0 <= sde_window[0] < sde_window[1] <= num_steps):
            raise ValueError(f"sde_window={sde_window} must satisfy 0 <= start < end <= num_steps={num_steps}")
        self.num_steps = num_steps
        self.shift = shift
        self.guidance_scale = guidance_scale
        self.noise_level = noise_level
        self.sde_window = sde_window

    def sigmas(self) -> torch.Tensor:
        return sigma_schedule(self.num_steps, self.shift)

    @property
    def sigma_cap(self) -> float:
        return float(self.sigmas()[1])

    def velocity(self, model: VelocityFn, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor,
                 uncond: Optional[torch.Tensor] = None, guidance_scale: Optional[float] = None) -> torch.Tensor:
        """Guided float32 velocity; the conditional and unconditional passes share one batched forward."""
        g = self.guidance_scale if guidance_scale is None else guidance_scale
        sigma_b = sigma.float().expand(x.shape[0]).to(x.device)
        if uncond is None or g == 1.0:
            return model(x, sigma_b, cond).float()
        both = model(torch.cat([x, x]), torch.cat([sigma_b, sigma_b]), torch.cat([cond, uncond])).float()
        v_cond, v_uncond = both.chunk(2)
        return guided(v_cond, v_uncond, g)

    def sde_steps(self) -> torch.Tensor:
        mask = torch.zeros(self.num_steps, dtype=torch.bool)
        start, end = self.sde_window or (0, self.num_steps)
        mask[start:end] = True
        return mask

    def sample(self, model: VelocityFn, noise: torch.Tensor, cond: torch.Tensor,
               uncond: Optional[torch.Tensor] = None, sde: bool = False, capture: bool = False,
               generator: Optional[torch.Generator] = None,
               guidance_scale: Optional[float] = None) -> Trajectory:
        """Denoise ``noise`` (B, C, F, H, W) from σ = 1 to 0. ``sde=True`` is the RL rollout."""
        sigmas = self.sigmas()
        sde_mask = self.sde_steps() if sde else torch.zeros(self.num_steps, dtype=torch.bool)
        x = noise.float()
        xs, log_probs = [x], []
        for i in range(self.num_steps):
            sigma, sigma_next = sigmas[i], sigmas[i + 1]
            # 1. velocity at (x, σ), guided
            v = self.velocity(model, x.to(noise.dtype), sigma, cond, uncond, guidance_scale)
            # 2. move to σ_next: SDE step with its log-probability, or the plain Euler ODE step
            if sde_mask[i]:
                step = sde_step(x, v, sigma, sigma_next, self.noise_level, self.sigma_cap, generator=generator)
                x, lp = step.x_next, step.log_prob
            else:
                x = x + (sigma_next - sigma) * v
                lp = torch.zeros(x.shape[0], device=x.device)
            if capture:
                xs.append(x)
                log_probs.append(lp)
        return Trajectory(
            latents=x, sigmas=sigmas,
            xs=torch.stack(xs) if capture else None,
            log_probs=torch.stack(log_probs) if capture else None,
            sde_mask=sde_mask,
        )

    def step_log_prob(self, model: VelocityFn, traj: Trajectory, i: int, cond: torch.Tensor,
                      uncond: Optional[torch.Tensor] = None, index: Optional[torch.Tensor] = None,
                      guidance_scale: Optional[float] = None) -> SDEStep:
        """Recompute step ``i``'s log p of the stored transition under the current weights (with grad).

        ``index`` selects a subset of the batch. At the rollout's weights this reproduces the stored
        log p (the C2 identity, PPO ratio 1).
        """
        if traj.xs is None:
            raise ValueError("the trajectory was sampled without capture=True; nothing to recompute")
        sigmas = traj.sigmas
        x, x_next = traj.xs[i], traj.xs[i + 1]
        if index is not None:
            x, x_next = x[index], x_next[index]
        v = self.velocity(model, x, sigmas[i], cond, uncond, guidance_scale)
        return sde_step(x, v, sigmas[i], sigmas[i + 1], self.noise_level, self.sigma_cap, x_next=x_next)


def wan_velocity(transformer: torch.nn.Module) -> VelocityFn:
    """Wan's transformer as a velocity function: timesteps are σ·1000 (diffusers' flow-match scheduler)."""

    def fn(x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        dtype = next(transformer.parameters()).dtype
        return transformer(hidden_states=x.to(dtype), timestep=sigma * 1000, encoder_hidden_states=cond.to(dtype),
                           return_dict=False)[0]

    return fn
