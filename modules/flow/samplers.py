"""The one flow-matching sampler: serving (ODE, CFG) and RL rollouts (FlowGRPO SDE, log p).

Flow matching with ``x_σ = (1-σ)·x0 + σ·ε`` and velocity ``v ≈ ε - x0``; σ runs 1 → 0. The σ grid
and the timesteps the transformer reads come from a **diffusers scheduler object** (set in YAML;
``FlowMatchEulerDiscreteScheduler(shift=3.0)`` by default), prepared exactly as the diffusers pipelines
prepare it (``scheduler.set_timesteps``; the generator adapter adds what its pipeline passes, e.g.
FLUX's resolution-dependent ``mu``), and export writes that same scheduler, so an exported pipeline
folder run by ``WanPipeline`` reproduces ``predict`` from the same noise.

- ODE steps: the Euler step ``x + (σ_next - σ)·v`` for ``FlowMatchEulerDiscreteScheduler`` (what its
  ``step`` computes), ``scheduler.step`` for any other flow scheduler (e.g. UniPC, as Wan ships), on a
  fresh copy of the scheduler per call (multistep schedulers keep history).
- SDE steps (rollouts only, switched on per call, never by default): Flow-GRPO's step with its
  per-step log-probability (Liu et al. 2025, eq. 9–12, reference
  ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``); diffusers has none. They need the Euler
  scheduler: a multistep ODE solver has no per-step transition density.
- Few-step students (DMD2, Self-Forcing): ``step_sigmas`` is the student's step list (σ before the flow
  shift, e.g. [1, .75, .5, .25]), handed to ``scheduler.set_timesteps(sigmas=...)``, which shifts it as
  it shifts its own grid. Their step is the re-noise rule of the anchors, ``x_next = (1-σ')·x̂0 + σ'·ε``
  with fresh ε (``FlowMatchEulerDiscreteScheduler(stochastic_sampling=True)``'s ``step``, computed here
  in float32 from the call's ``rng``). ``exit_step=k`` stops at step k and returns its x̂0 = x - σ_k·v:
  steps before k run under ``no_grad``, step k keeps the caller's grad (DMD2's backward simulation,
  Self-Forcing's exit step).
- Clean latents (``CleanLatents``, from the generator adapter): entries held at given values from the noise to
  the sample — Wan 2.2 TI2V's image-to-video keeps its first latent frame at the image's latents
  (``WanImageToVideoPipeline`` with ``expand_timesteps``). Every step writes them back; an SDE step draws no noise
  there and its log-probability is the density of the other entries.
- Block-causal students (Self-Forcing): ``chunk_frames`` latent frames at a time, each chunk denoised
  through the whole step list while attending to the finished chunks in a KV cache, then re-run once at
  σ = 0 without grad to store its keys/values (Self-Forcing ``pipeline/self_forcing_training.py``).
  Serving a causal student is the same chunk loop.

``predict``, sample logging and every rollout go through ``FlowMatchSampler.sample``. Everything
numeric here runs in float32.
"""
from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.guiders.guider_utils import rescale_noise_cfg
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from posttrain.modules.flow.conditioning import Conditioning

# (x (B, C, F, H, W), timestep (B,) as the scheduler gives it, conditioning) -> velocity, same shape as x.
# The chunk loop also passes a block-causal model's ``kv_cache=`` and ``update_cache=`` keywords.
VelocityFn = Callable[..., torch.Tensor]


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """Flow shift used by Wan/FLUX/SD3: σ' = s·σ / (1 + (s-1)·σ)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def is_flow_scheduler(scheduler: Any) -> bool:
    """A diffusers scheduler that integrates a flow-matching velocity (σ from 1 to 0)."""
    config = getattr(scheduler, "config", {})
    return isinstance(scheduler, FlowMatchEulerDiscreteScheduler) or bool(config.get("use_flow_sigmas", False)) \
        or config.get("prediction_type") == "flow_prediction"


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


def gaussian_log_prob(x_next: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor,
                      free: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B,) mean over non-batch dims of log N(x_next; mean, scale²), with ``scale`` = std·sqrt(-dt); with ``free``
    (bool, broadcastable to ``mean``) the mean over the entries where it is True only (clean entries are no random
    variable of the step)."""
    scale = _bcast(scale, mean)
    lp = -((x_next.float() - mean) ** 2) / (2 * scale**2) - torch.log(scale) - 0.5 * math.log(2 * math.pi)
    dims = tuple(range(1, lp.ndim))
    if free is None:
        return lp.mean(dim=dims)
    weight = free.to(lp.device, lp.dtype).expand_as(lp)
    return (lp * weight).sum(dim=dims) / weight.sum(dim=dims)


@dataclass
class CleanLatents:
    """Latents a sampling call holds clean: where ``mask`` is True, x is ``latents`` at every σ, from the noise to
    the sample (Wan 2.2 TI2V's image-to-video: the first latent frame is the image's, ``WanImageToVideoPipeline``
    with ``expand_timesteps``). The generator adapter gives them (``GeneratorAdapter.clean_latents``).

    Args:
        mask: bool, broadcastable to x (B, C, F, H, W): (1, 1, F, 1, 1) True on the first frame.
        latents: (B, C, F or 1, H, W), broadcast against x where ``mask`` holds.
    """

    mask: torch.Tensor
    latents: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x with the clean entries written in."""
        return torch.where(self.mask.to(x.device), self.latents.to(x.device, x.dtype), x)

    def select(self, index: Optional[torch.Tensor]) -> "CleanLatents":
        """The rows ``index`` (a per-row tensor keeps its rows, a shared one (first dimension 1) stays)."""
        if index is None:
            return self

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t if t.shape[0] == 1 else t[index.to(t.device)]

        return CleanLatents(rows(self.mask), rows(self.latents))


@dataclass
class SDEStep:
    x_next: torch.Tensor  # (B, ...)
    log_prob: torch.Tensor  # (B,)
    mean: torch.Tensor  # (B, ...)
    std: torch.Tensor  # (B,) or (): the σ-level std, before sqrt(-dt)


def sde_step(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor, noise_level: float,
             sigma_cap: float, x_next: Optional[torch.Tensor] = None,
             rng: Optional[torch.Generator] = None, clean: Optional[CleanLatents] = None) -> SDEStep:
    """One Flow-GRPO SDE step. With ``x_next`` given, only its log-probability is computed (PPO recompute). With
    ``clean``, the clean entries of the mean and of x_next are their clean values (no noise lands there, a KL of
    means is 0 there) and the log-probability is over the other entries."""
    sigma = sigma.float().to(x.device)
    sigma_next = sigma_next.float().to(x.device)
    std = sde_std(sigma, noise_level, sigma_cap)
    mean = sde_mean(x, v, sigma, sigma_next, std)
    scale = std * torch.sqrt(sigma - sigma_next)
    if x_next is None:
        noise = torch.randn(mean.shape, generator=rng, device="cpu" if rng is None else rng.device)
        x_next = mean + _bcast(scale, mean) * noise.to(mean.device)
    if clean is None:
        return SDEStep(x_next=x_next, log_prob=gaussian_log_prob(x_next, mean, scale), mean=mean, std=std)
    mean, x_next = clean.apply(mean), clean.apply(x_next)
    free = ~clean.mask.to(mean.device)
    return SDEStep(x_next=x_next, log_prob=gaussian_log_prob(x_next, mean, scale, free), mean=mean, std=std)


def ml_velocity(x: torch.Tensor, x_next: torch.Tensor, sigma, sigma_next, noise_level: float,
                sigma_cap: float) -> torch.Tensor:
    """The velocity whose SDE mean lands exactly on ``x_next``: v* = (x_next - x·A) / B."""
    s, s_next = _bcast(torch.as_tensor(sigma), x), _bcast(torch.as_tensor(sigma_next), x)
    std = sde_std(s, noise_level, sigma_cap)
    dt = s_next - s
    a = 1 + std**2 * dt / (2 * s)
    b = (1 + std**2 * (1 - s) / (2 * s)) * dt
    return (x_next.float() - x.float() * a) / b


def renoise_step(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
                 rng: Optional[torch.Generator] = None) -> torch.Tensor:
    """The few-step students' step (DMD2, Self-Forcing): x̂0 = x - σ·v, then ``x_next = (1-σ')·x̂0 + σ'·ε``
    with fresh ε — ``FlowMatchEulerDiscreteScheduler(stochastic_sampling=True).step``, in float32. At σ' = 0
    it is x̂0 and draws nothing."""
    x0 = x.float() - _bcast(sigma, x) * v.float()
    if float(sigma_next) == 0.0:
        return x0
    noise = torch.randn(x0.shape, generator=rng, device="cpu" if rng is None else rng.device)
    return (1 - _bcast(sigma_next, x0)) * x0 + _bcast(sigma_next, x0) * noise.to(x0.device)


def guided(v_cond: torch.Tensor, v_uncond: Optional[torch.Tensor], scale: float | torch.Tensor, rescale: float = 0.0
           ) -> torch.Tensor:
    """Classifier-free guidance: v = v_u + g·(v_c - v_u); with ``rescale`` φ > 0, each sample's guided v is pulled
    toward the conditional one's standard deviation (Lin et al. 2023, §3.4: diffusers' ``rescale_noise_cfg``,
    the pipelines' ``guidance_rescale``). ``scale``: one for all, or a (B,) tensor, one per sample."""
    if v_uncond is None or _unguided(scale):
        return v_cond
    if isinstance(scale, torch.Tensor):
        scale = scale.to(v_cond).reshape(-1, *([1] * (v_cond.ndim - 1)))
    v = v_uncond + scale * (v_cond - v_uncond)
    return rescale_noise_cfg(v, v_cond, guidance_rescale=rescale) if rescale > 0 else v


def _unguided(scale: float | torch.Tensor) -> bool:
    return bool((scale == 1.0).all()) if isinstance(scale, torch.Tensor) else scale == 1.0


@dataclass
class Schedule:
    """The prepared σ grid of one sampling call and the scheduler copy that steps it."""

    sigmas: torch.Tensor  # (T + 1,) float32, from ~1 down to 0
    timesteps: torch.Tensor  # (T,) what the transformer reads at each step (the scheduler's timesteps)
    scheduler: SchedulerMixin  # a fresh copy with ``set_timesteps`` applied

    @property
    def sigma_cap(self) -> float:
        """The first σ below 1: the SDE std's denominator at σ = 1 (Flow-GRPO)."""
        below = self.sigmas[self.sigmas < 1]
        return float(below[0]) if len(below) else 0.0


@dataclass
class Trajectory:
    """A sampled batch. ``xs``/``log_probs`` are filled when the rollout captured them."""

    latents: torch.Tensor  # (B, C, F, H, W) clean sample at σ = 0
    sigmas: torch.Tensor  # (T + 1,)
    timesteps: torch.Tensor  # (T,)
    xs: Optional[torch.Tensor] = None  # (T + 1, B, ...) x at each σ, xs[0] the noise
    log_probs: Optional[torch.Tensor] = None  # (T, B) log p of each SDE step (0 for ODE steps)
    sde_mask: Optional[torch.Tensor] = None  # (T,) bool, which steps were stochastic
    sigma_cap: float = 0.0
    clean: Optional[CleanLatents] = None  # the entries held clean (an image-to-video model's first frame)


def _cat(a: Union[Conditioning, torch.Tensor], b: Union[Conditioning, torch.Tensor]):
    return Conditioning.cat([a, b]) if isinstance(a, Conditioning) else torch.cat([a, b])


class FlowMatchSampler:
    """Flow-matching sampler over a diffusers scheduler's σ grid: ODE by default, Flow-GRPO SDE on request.

    Args:
        num_steps: denoising steps (``num_inference_steps`` of the pipelines).
        scheduler: a diffusers flow-matching scheduler; None = ``FlowMatchEulerDiscreteScheduler(shift=3.0)``.
            Its config (``shift``, …) is what export writes into ``scheduler/``.
        guidance_scale: classifier-free guidance; 1 disables the unconditional pass. Every call of this sampler
            (serving, a rollout and its recompute) guides with it: a role that guides otherwise has its own
            sampler (a method's ``rollout_sampler``, ``teacher_sampler``).
        guidance_scale_2: a pair of noise experts (Wan 2.2 A14B): the CFG scale of the low-noise expert's steps,
            ``guidance_scale`` guiding the high-noise one's (``WanPipeline``'s ``guidance_scale_2``; the Wan 2.2
            repository's A14B: 4.0 and 3.0). None = ``guidance_scale`` for both. Needs ``guidance_scale`` != 1 (the
            unconditional pass is made for CFG).
        guidance_rescale: φ of CFG rescale (the diffusers pipelines' ``guidance_rescale``; Lin et al. 2023
            anchor 0.7): the guided velocity's per-sample std is blended toward the conditional one's, against
            over-saturated colour at high CFG. 0 = plain CFG.
        noise_level: the SDE's ``a`` (Flow-GRPO anchor 0.7).
        sde_window: ``(start, end)`` step indices that are stochastic in an SDE rollout; None = all.
        step_sigmas: a few-step student's step list, σ of each step before the scheduler's flow shift
            (DMD2/Self-Forcing anchor [1.0, 0.75, 0.5, 0.25]); its length must be ``num_steps``.
            None = the scheduler's own grid of ``num_steps``.
        chunk_frames: latent frames per chunk of a block-causal transformer (``arch: wan_t2v_causal``):
            sample chunk by chunk with a KV cache. None = the whole video in one pass.
        cache_chunks: W, a rolling KV cache (Self-Forcing++): each chunk attends to the last W finished chunks
            (and the first ``sink_chunks``), older ones are evicted, so memory stays bounded on a video of any
            length. None = every finished chunk stays.
        sink_chunks: the first chunks a rolling cache never evicts (Self-Forcing's ``sink_size``; anchor 0).
    """

    def __init__(self, num_steps: int = 20, scheduler: Optional[SchedulerMixin] = None, guidance_scale: float = 1.0,
                 noise_level: float = 0.7, sde_window: Optional[tuple[int, int]] = None,
                 step_sigmas: Optional[list[float]] = None, chunk_frames: Optional[int] = None,
                 cache_chunks: Optional[int] = None, sink_chunks: int = 0, guidance_rescale: float = 0.0,
                 guidance_scale_2: Optional[float] = None):
        if num_steps < 1:
            raise ValueError(f"sampler: num_steps={num_steps} must be >= 1 (e.g. 20; a distilled student 4)")
        if step_sigmas is not None:
            steps = [float(s) for s in step_sigmas]
            if not steps:
                raise ValueError("sampler: step_sigmas=[] is empty; give the student's steps, e.g. "
                                 "step_sigmas: [1.0, 0.75, 0.5, 0.25] with num_steps: 4, or remove step_sigmas")
            if not all(0 < s <= 1 for s in steps) or any(a <= b for a, b in zip(steps, steps[1:])):
                raise ValueError(f"sampler: step_sigmas={steps} must decrease strictly within (0, 1] (σ = 0 is "
                                 f"appended by the scheduler)")
            if len(steps) != num_steps:
                raise ValueError(f"sampler: step_sigmas={steps} has {len(steps)} steps but num_steps={num_steps}; "
                                 f"set num_steps: {len(steps)}")
            step_sigmas = steps
        if chunk_frames is not None and chunk_frames < 1:
            raise ValueError(f"sampler: chunk_frames={chunk_frames} must be >= 1 latent frame (or null: no chunks)")
        if cache_chunks is not None and (chunk_frames is None or cache_chunks < 1):
            raise ValueError(f"sampler: cache_chunks={cache_chunks} (a rolling KV cache of the last W finished chunks) "
                             f"needs chunk_frames and W >= 1 (e.g. chunk_frames: 1, cache_chunks: 5), or null: keep all")
        if sink_chunks < 0 or (sink_chunks and cache_chunks is None):
            raise ValueError(f"sampler: sink_chunks={sink_chunks} must be >= 0 and needs cache_chunks (the first "
                             f"chunks a rolling KV cache keeps besides its window), or 0")
        if sde_window is not None and not (0 <= sde_window[0] < sde_window[1] <= num_steps):
            raise ValueError(f"sampler: sde_window={sde_window} must satisfy 0 <= start < end <= num_steps={num_steps}")
        if not 0.0 <= guidance_rescale <= 1.0:
            raise ValueError(f"sampler: guidance_rescale={guidance_rescale} must be in [0, 1] (0 = plain CFG; Lin "
                             f"et al. use 0.7)")
        if noise_level < 0:
            raise ValueError(f"sampler: noise_level={noise_level} must be >= 0 (the SDE's noise scale; 0 is the ODE, "
                             f"Flow-GRPO uses 0.7)")
        scheduler = scheduler if scheduler is not None else FlowMatchEulerDiscreteScheduler(shift=3.0)
        shift = scheduler.config.get("shift", 1.0)
        if shift is not None and shift <= 0:
            raise ValueError(f"sampler: scheduler shift={shift} must be > 0 (1 = no shift; Wan uses 3 to 5)")
        if not is_flow_scheduler(scheduler):
            raise ValueError(f"sampler: scheduler {type(scheduler).__name__} is not a flow-matching scheduler; use "
                             f"diffusers.FlowMatchEulerDiscreteScheduler, or e.g. UniPCMultistepScheduler with "
                             f"use_flow_sigmas: true and prediction_type: flow_prediction")
        self.num_steps = num_steps
        self.scheduler = scheduler
        if guidance_scale_2 is not None and guidance_scale == 1.0:
            raise ValueError(f"sampler: guidance_scale_2={guidance_scale_2} guides the low-noise expert of a pair when "
                             f"guidance_scale guides the high-noise one, but guidance_scale is 1 (no CFG): set "
                             f"guidance_scale, or drop guidance_scale_2")
        self.guidance_scale, self.guidance_rescale = guidance_scale, guidance_rescale
        self.guidance_scale_2 = guidance_scale_2
        self.noise_level = noise_level
        self.sde_window = sde_window
        self.step_sigmas = step_sigmas
        self.chunk_frames = chunk_frames
        self.cache_chunks, self.sink_chunks = cache_chunks, sink_chunks
        if step_sigmas is not None:
            self.schedule()  # a scheduler that takes no custom σ list stops here, not mid-run

    @property
    def euler(self) -> bool:
        """Whether ODE steps are plain Euler (and SDE rollouts are possible)."""
        return isinstance(self.scheduler, FlowMatchEulerDiscreteScheduler) \
            and not self.scheduler.config.get("stochastic_sampling", False)

    @property
    def renoise(self) -> bool:
        """Whether steps re-noise the predicted x̂0 with fresh noise (``stochastic_sampling``: few-step students)."""
        return isinstance(self.scheduler, FlowMatchEulerDiscreteScheduler) \
            and bool(self.scheduler.config.get("stochastic_sampling", False))

    @property
    def num_train_timesteps(self) -> int:
        return int(self.scheduler.config.get("num_train_timesteps", 1000))

    def timestep_of(self, sigma: torch.Tensor) -> torch.Tensor:
        """The timestep a transformer reads at noise level σ outside a schedule (training): σ·T_train."""
        return sigma * self.num_train_timesteps

    def schedule(self, device: Optional[torch.device] = None, **set_timesteps_kwargs) -> Schedule:
        """σ grid and timesteps as the pipelines prepare them: ``scheduler.set_timesteps(num_steps, ...)``
        on a fresh copy (extra keyword arguments such as FLUX's ``sigmas``/``mu`` come from the adapter)."""
        scheduler = copy.deepcopy(self.scheduler)
        if self.step_sigmas is not None:  # the student's list replaces the pipeline's default grid
            set_timesteps_kwargs = {**set_timesteps_kwargs, "sigmas": list(self.step_sigmas)}
        try:
            scheduler.set_timesteps(self.num_steps, device=device, **set_timesteps_kwargs)
        except TypeError as err:
            raise ValueError(f"sampler: {type(scheduler).__name__}.set_timesteps does not take "
                             f"{sorted(set_timesteps_kwargs)} ({err}); step_sigmas needs a scheduler that takes a "
                             f"σ list, e.g. FlowMatchEulerDiscreteScheduler") from err
        sigmas = scheduler.sigmas.to(device=device, dtype=torch.float32)
        timesteps = scheduler.timesteps.to(device)
        if len(sigmas) != self.num_steps + 1 or len(timesteps) != self.num_steps or float(sigmas[-1]) != 0.0:
            raise ValueError(f"sampler: {type(scheduler).__name__} gave {len(timesteps)} timesteps and σ ending at "
                             f"{float(sigmas[-1]):.3g} for num_steps={self.num_steps}; a first-order flow schedule "
                             f"of num_steps steps ending at σ = 0 is needed")
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(0)
        return Schedule(sigmas=sigmas, timesteps=timesteps, scheduler=scheduler)

    def velocity(self, model: VelocityFn, x: torch.Tensor, timestep: torch.Tensor, cond, uncond=None,
                 guidance_scale: Optional[float | torch.Tensor] = None, guidance_rescale: Optional[float] = None
                 ) -> torch.Tensor:
        """Guided float32 velocity; the conditional and unconditional passes share one batched forward.
        ``guidance_scale``, ``guidance_rescale``: this call's CFG scale (or (B,) scales, one per sample) and
        rescale instead of the sampler's. A pair of noise experts (``model.boundary_timestep``) guides the
        low-noise expert's rows with ``guidance_scale_2`` where it is set."""
        g = self.guidance_scale if guidance_scale is None else guidance_scale
        phi = self.guidance_rescale if guidance_rescale is None else guidance_rescale
        t = timestep.expand(x.shape[0]).to(x.device)
        boundary = getattr(model, "boundary_timestep", None)
        if guidance_scale is None and self.guidance_scale_2 is not None and boundary is not None:
            low = t < boundary  # a sampling step: one timestep, one expert, one scale
            g = self.guidance_scale_2 if bool(low.all()) else g if not bool(low.any()) else \
                torch.where(low, self.guidance_scale_2, g)
        if uncond is None or _unguided(g):
            return model(x, t, cond).float()
        both = model(torch.cat([x, x]), torch.cat([t, t]), _cat(cond, uncond)).float()
        v_cond, v_uncond = both.chunk(2)
        # a generator whose pipeline guides otherwise says so on its velocity function (QwenImagePipeline's true CFG)
        return getattr(model, "guided", guided)(v_cond, v_uncond, g, phi)

    def sde_steps(self) -> torch.Tensor:
        mask = torch.zeros(self.num_steps, dtype=torch.bool)
        start, end = self.sde_window or (0, self.num_steps)
        mask[start:end] = True
        return mask

    def sample(self, model: VelocityFn, noise: torch.Tensor, cond, uncond=None, sde: bool = False,
               capture: bool = False, rng: Optional[torch.Generator] = None, schedule: Optional[Schedule] = None,
               exit_step: Optional[int] = None, kv_cache: Any = None,
               clean: Optional[CleanLatents] = None) -> Trajectory:
        """Denoise ``noise`` (B, C, F, H, W) from σ = 1 to 0. ``sde=True`` is the RL rollout.

        ``schedule`` is the prepared grid (the generator adapter's ``schedule``); None = this sampler's
        plain ``schedule()``. ``rng`` draws the SDE noise and the re-noise rule's fresh noise.
        ``exit_step=k``: stop at step k and return its x̂0 (steps before k under ``no_grad``, step k with the
        caller's grad). With ``chunk_frames`` set, ``kv_cache`` is the causal model's empty cache (the
        generator stage makes one) and ``model`` takes ``kv_cache``/``update_cache`` keywords. ``clean``: entries
        held at given values at every step (``CleanLatents``; the generator stage asks its adapter).
        """
        if sde and not self.euler:
            raise ValueError(f"sampler: SDE rollouts need FlowMatchEulerDiscreteScheduler, got "
                             f"{type(self.scheduler).__name__} (a multistep solver has no per-step log p); keep "
                             f"it for serving and roll out with the Euler scheduler")
        if exit_step is not None and not 0 <= exit_step < self.num_steps:
            raise ValueError(f"sampler: exit_step={exit_step} must be in [0, num_steps={self.num_steps})")
        if exit_step is not None and (sde or capture):
            raise ValueError("sampler: exit_step returns one x̂0 with grad; it does not combine with sde/capture")
        schedule = schedule or self.schedule(noise.device)
        if self.chunk_frames is None:
            return self._denoise(model, noise, cond, uncond, sde, capture, rng, schedule, exit_step, clean)
        if clean is not None:
            raise ValueError("sampler: chunked sampling (chunk_frames) holds no clean latents; an image-to-video "
                             "generator samples the whole video in one pass (chunk_frames: null)")

        # Block-causal: chunk by chunk, each attending to the finished chunks through the KV cache
        # (Self-Forcing ``pipeline/self_forcing_training.py``; CausVid's ``inference.py``).
        n, num_frames = self.chunk_frames, noise.shape[2]
        if num_frames % n:
            raise ValueError(f"sampler: chunk_frames={n} does not divide the {num_frames} latent frames; choose a "
                             f"divisor of {num_frames} or change run.frames")
        if sde or capture:
            raise ValueError("sampler: chunked sampling (chunk_frames) has no SDE rollout or capture")
        if kv_cache is None:
            raise ValueError(f"sampler: chunk_frames={n} needs the causal model's kv_cache (GeneratorStage.sample "
                             f"makes one)")
        if self.cache_chunks is not None:  # the cache rolls: the last W finished chunks (and the sink) stay
            if kv_cache.num_frames:
                raise ValueError("sampler: cache_chunks rolls a fresh KV cache; this one already holds frames")
            kv_cache.window_frames, kv_cache.sink_frames = self.cache_chunks * n, self.sink_chunks * n
        chunks = []
        for start in range(0, num_frames, n):
            # 1. denoise this chunk's noise through the step list; the cache is read, not written
            def reader(x, t, c):
                return model(x, t, c, kv_cache=kv_cache)

            chunk = self._denoise(reader, noise[:, :, start:start + n], cond, uncond, False, False, rng, schedule,
                                  exit_step).latents
            chunks.append(chunk)
            # 2. the finished chunk, re-run at σ = 0 without grad, stores its keys/values for the next chunks
            if start + n < num_frames:
                def writer(x, t, c):
                    return model(x, t, c, kv_cache=kv_cache, update_cache=True)

                with torch.no_grad():
                    self.velocity(writer, chunk.detach(), torch.zeros((), device=chunk.device), cond, uncond)
        return Trajectory(latents=torch.cat(chunks, dim=2), sigmas=schedule.sigmas, timesteps=schedule.timesteps,
                          sde_mask=torch.zeros(self.num_steps, dtype=torch.bool), sigma_cap=schedule.sigma_cap)

    def _denoise(self, model: VelocityFn, noise: torch.Tensor, cond, uncond, sde: bool, capture: bool,
                 rng: Optional[torch.Generator], schedule: Schedule, exit_step: Optional[int],
                 clean: Optional[CleanLatents] = None) -> Trajectory:
        """The step loop over ``schedule`` (one chunk, or the whole video); ``clean`` entries written back at
        every σ."""
        sigmas, timesteps = schedule.sigmas, schedule.timesteps
        sde_mask = self.sde_steps() if sde else torch.zeros(self.num_steps, dtype=torch.bool)
        last = self.num_steps - 1 if exit_step is None else exit_step
        x = noise.float() if clean is None else clean.apply(noise.float())
        xs, log_probs = [x], []
        for i in range(last + 1):
            sigma, sigma_next = sigmas[i], sigmas[i + 1]
            # steps before the exit step carry no grad (DMD2 backward simulation, Self-Forcing)
            with torch.no_grad() if i < last and exit_step is not None else contextlib.nullcontext():
                # 1. velocity at (x, t_i), guided
                v = self.velocity(model, x, timesteps[i], cond, uncond)
                if i == exit_step:  # 2'. the exit step returns its x̂0 = x - σ·v (with grad)
                    x = x - _bcast(sigma, x) * v
                    x = x if clean is None else clean.apply(x)
                    break
                # 2. move to σ_next: SDE step with its log-probability, or the ODE / re-noise step
                if sde_mask[i]:
                    step = sde_step(x, v, sigma, sigma_next, self.noise_level, schedule.sigma_cap,
                                    rng=rng, clean=clean)
                    x, lp = step.x_next, step.log_prob
                else:
                    if self.euler:
                        x = x + (sigma_next - sigma) * v  # = FlowMatchEulerDiscreteScheduler.step, in float32
                    elif self.renoise:
                        x = renoise_step(x, v, sigma, sigma_next, rng)
                    else:
                        x = schedule.scheduler.step(v, timesteps[i], x, return_dict=False)[0].float()
                    x = x if clean is None else clean.apply(x)
                    lp = torch.zeros(x.shape[0], device=x.device)
            if capture:
                xs.append(x)
                log_probs.append(lp)
        return Trajectory(
            latents=x, sigmas=sigmas, timesteps=timesteps,
            xs=torch.stack(xs) if capture else None,
            log_probs=torch.stack(log_probs) if capture else None,
            sde_mask=sde_mask, sigma_cap=schedule.sigma_cap, clean=clean,
        )

    def step_log_prob(self, model: VelocityFn, traj: Trajectory, i: int, cond, uncond=None,
                      index: Optional[torch.Tensor] = None) -> SDEStep:
        """Recompute step ``i``'s log p of the stored transition under the current weights (with grad).

        ``cond``/``uncond`` are of the rows selected by ``index`` (a subset of the batch). At the
        rollout's weights this reproduces the stored log p (log-probability parity, PPO ratio 1).
        """
        if traj.xs is None:
            raise ValueError("the trajectory was sampled without capture=True; nothing to recompute")
        x, x_next = traj.xs[i], traj.xs[i + 1]
        if index is not None:
            x, x_next = x[index], x_next[index]
        v = self.velocity(model, x, traj.timesteps[i], cond, uncond)
        clean = None if traj.clean is None else traj.clean.select(index)
        return sde_step(x, v, traj.sigmas[i], traj.sigmas[i + 1], self.noise_level, traj.sigma_cap, x_next=x_next,
                        clean=clean)
