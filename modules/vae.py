"""Pixels <-> normalized latents for the VAEs on a card.

Video is (B, C, F, H, W) in [-1, 1]; an image is a one-frame video. ``AutoencoderKLWan`` normalizes
with its per-channel ``latents_mean``/``latents_std`` (as diffusers' WanPipeline); ``AutoencoderKL``
with ``(z - shift_factor)·scaling_factor`` (as the FLUX pipeline).
"""
from __future__ import annotations

import torch
from diffusers import AutoencoderKL, AutoencoderKLWan


def _wan_stats(vae: AutoencoderKLWan, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean, device=like.device, dtype=torch.float32).view(shape)
    std = torch.tensor(vae.config.latents_std, device=like.device, dtype=torch.float32).view(shape)
    return mean, std


@torch.no_grad()
def encode(vae: torch.nn.Module, video: torch.Tensor, sample: bool = False,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, C, F, H, W) pixels -> (B, z, F', H/s, W/s) normalized float32 latents (mode unless ``sample``);
    s is the VAE's spatial compression (``spatial_factor``)."""
    dtype = next(vae.parameters()).dtype
    if isinstance(vae, AutoencoderKLWan):
        dist = vae.encode(video.to(dtype)).latent_dist
        z = (dist.sample(generator) if sample else dist.mode()).float()
        mean, std = _wan_stats(vae, z)
        return (z - mean) / std
    if isinstance(vae, AutoencoderKL):
        frames = video.to(dtype).permute(0, 2, 1, 3, 4).flatten(0, 1)  # (B·F, C, H, W)
        dist = vae.encode(frames).latent_dist
        z = (dist.sample(generator) if sample else dist.mode()).float()
        z = (z - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor
        return z.unflatten(0, (video.shape[0], video.shape[2])).permute(0, 2, 1, 3, 4)
    raise TypeError(f"no latent codec for {type(vae).__name__}")


def decode(vae: torch.nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """(B, z, F', h, w) normalized latents -> (B, C, F, H, W) pixels clamped to [-1, 1]."""
    dtype = next(vae.parameters()).dtype
    if isinstance(vae, AutoencoderKLWan):
        mean, std = _wan_stats(vae, latents)
        video = vae.decode((latents.float() * std + mean).to(dtype), return_dict=False)[0]
        return video.float().clamp(-1, 1)
    if isinstance(vae, AutoencoderKL):
        z = latents.permute(0, 2, 1, 3, 4).flatten(0, 1).float()
        z = z / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        frames = vae.decode(z.to(dtype), return_dict=False)[0].float().clamp(-1, 1)
        return frames.unflatten(0, (latents.shape[0], latents.shape[2])).permute(0, 2, 1, 3, 4)
    raise TypeError(f"no latent codec for {type(vae).__name__}")


def spatial_factor(vae: torch.nn.Module) -> int:
    """Pixels per latent pixel along H and W: 2 per down level (diffusers' ``vae_scale_factor``)."""
    if isinstance(vae, AutoencoderKLWan):
        return 2 ** len(vae.config.temperal_downsample)
    return 2 ** (len(vae.config.block_out_channels) - 1)


def latent_shape(vae: torch.nn.Module, frames: int, height: int, width: int) -> tuple[int, int, int, int]:
    """(C, F', h, w) of the latents of a (frames, height, width) video."""
    s = spatial_factor(vae)
    if isinstance(vae, AutoencoderKLWan):
        t = 2 ** sum(vae.config.temperal_downsample)
        if (frames - 1) % t or height % s or width % s:
            raise ValueError(f"this Wan VAE needs frames = {t}k+1 and H, W multiples of {s}; "
                             f"got {frames}x{height}x{width}")
        return vae.config.z_dim, (frames - 1) // t + 1, height // s, width // s
    return vae.config.latent_channels, frames, height // s, width // s
