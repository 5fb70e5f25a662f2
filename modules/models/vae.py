"""Pixels <-> normalized latents for the VAEs on a card.

Video is (B, C, F, H, W) in [-1, 1]; an image is a one-frame video. How a VAE normalizes is its family's: each VAE
architecture declares a codec beside it (``modules/models/generators/<family>.py``: ``AutoencoderKLWan`` in
``wan.py``, normalized per channel by ``latents_mean``/``latents_std`` as diffusers' WanPipeline; ``AutoencoderKL``
in ``flux.py``, by ``(z - shift_factor)·scaling_factor`` as the image pipelines). The functions here find that codec
by the VAE's class, so a new VAE family is one new file there and no edit here.
"""
from __future__ import annotations

import torch

from posttrain.modules.models.generators.base import codec_of


@torch.no_grad()
def encode(vae: torch.nn.Module, video: torch.Tensor, sample: bool = False,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, C, F, H, W) pixels -> (B, z, F', h, w) normalized float32 latents (mode unless ``sample``)."""
    return codec_of(vae).encode(vae, video, sample, generator)


def decode(vae: torch.nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """(B, z, F', h, w) normalized latents -> (B, C, F, H, W) pixels clamped to [-1, 1]."""
    return codec_of(vae).decode(vae, latents)


def scale_factors(vae: torch.nn.Module) -> tuple[int, int]:
    """(temporal, spatial) compression of a VAE, from its config (as the diffusers pipelines read it); a config that
    disagrees with the layers that do the compressing is an error (latents of the wrong size otherwise)."""
    return codec_of(vae).scale_factors(vae)


def latent_shape(vae: torch.nn.Module, frames: int, height: int, width: int, patch: tuple[int, int] = (1, 1)
                 ) -> tuple[int, int, int, int]:
    """(C, F', h, w) latents of a (frames, height, width) video; a size the VAE (times the transformer's
    spatial ``patch``) cannot take is an error that names the option and a size that works."""
    return codec_of(vae).latent_shape(vae, frames, height, width, patch)
