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
    """(B, C, F, H, W) pixels -> (B, z, F', h, w) normalized float32 latents (mode unless ``sample``)."""
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


def scale_factors(vae: torch.nn.Module) -> tuple[int, int]:
    """(temporal, spatial) compression of a VAE, from its config (as the diffusers pipelines read it). A Wan VAE's
    ``scale_factor_*`` are plain config values beside the layers that do the compressing: one that disagrees with
    its ``dim_mult`` / ``temperal_downsample`` is an error here (latents of the wrong size otherwise)."""
    if isinstance(vae, AutoencoderKLWan):
        config = vae.config
        built = wan_compression(config)
        said = int(config.scale_factor_temporal or built[0]), int(config.scale_factor_spatial or built[1])
        if said != built:
            raise ValueError(f"the Wan VAE's config says scale_factor_temporal={said[0]}, scale_factor_spatial="
                             f"{said[1]}, but its layers (dim_mult {list(config.dim_mult)}, temperal_downsample "
                             f"{list(config.temperal_downsample)}) compress {built[0]}x in time and {built[1]}x in "
                             f"space: set scale_factor_temporal: {built[0]} and scale_factor_spatial: {built[1]} in "
                             f"its preset or config.json (or leave them out of a preset: they follow its layers)")
        return said
    return 1, 2 ** (len(vae.config.block_out_channels) - 1)


def wan_compression(config) -> tuple[int, int]:
    """(temporal, spatial) compression that an ``AutoencoderKLWan`` of ``config`` (its config or a preset)
    builds: each level but the last halves height and width, the levels marked in ``temperal_downsample`` time;
    Wan 2.2's ``patch_size`` folds a further factor into the channels."""
    patch = config.get("patch_size") or 1  # a diffusers config is a dict too (FrozenDict)
    return 2 ** sum(bool(t) for t in config["temperal_downsample"]), 2 ** (len(config["dim_mult"]) - 1) * patch


def wan_preset(config: dict, given: dict) -> dict:
    """A Wan VAE preset merged over another (``config``), its ``scale_factor_*`` following the merged layers unless
    ``given`` (the user's part) sets them: a preset of Wan2.1's 8x VAE over the world's 4x one builds an 8x VAE."""
    temporal, spatial = wan_compression(config)
    return {**config, "scale_factor_temporal": given.get("scale_factor_temporal", temporal),
            "scale_factor_spatial": given.get("scale_factor_spatial", spatial)}


def latent_shape(vae: torch.nn.Module, frames: int, height: int, width: int, patch: tuple[int, int] = (1, 1)
                 ) -> tuple[int, int, int, int]:
    """(C, F', h, w) latents of a (frames, height, width) video; a size the VAE (times the transformer's
    spatial ``patch``) cannot take is an error that names the option and a size that works."""
    temporal, spatial = scale_factors(vae)
    problems = []
    if (frames - 1) % temporal:
        problems.append(f"frames={frames} must be {temporal}k+1 (the VAE compresses time by {temporal}); "
                        f"e.g. {-(-max(frames - 1, 0) // temporal) * temporal + 1}")
    for name, value, p in (("height", height, patch[0]), ("width", width, patch[1])):
        if value < 1 or value % (spatial * p):
            problems.append(f"{name}={value} must be a multiple of {spatial * p} (VAE factor {spatial}"
                            f"{f' × patch {p}' if p > 1 else ''}); e.g. {max(1, -(-value // (spatial * p))) * spatial * p}")
    if problems:
        raise ValueError("video size: " + "; ".join(problems))
    config = vae.config
    channels = config.z_dim if isinstance(vae, AutoencoderKLWan) else config.latent_channels
    return channels, (frames - 1) // temporal + 1, height // spatial, width // spatial
