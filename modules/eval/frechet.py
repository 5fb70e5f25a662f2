"""Fréchet distance between sets of videos, frame by frame, through torchmetrics' FID machinery.

``FrechetInceptionDistance(feature=module)`` fits a Gaussian to the features of each set and returns
``|μ_r - μ_f|² + tr(Σ_r + Σ_f - 2(Σ_r Σ_f)^½)`` (Heusel et al. 2017). Which network makes the features
is pluggable: Inception-v3 gives the published FID (a local Inception or CLIP module on real runs);
the embedded default has no such network (nothing downloads), so it uses ``VAEFrameFeatures``: the
shipped Wan VAE's encoder on each frame, pooled. That number is a *Fréchet VAE distance*: it ranks
sample sets against data within this package, and is not comparable to any published FID.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.image.fid import FrechetInceptionDistance

from posttrain.modules.models import vae as vae_codec


class VAEFrameFeatures(nn.Module):
    """(N, 3, H, W) images in [-1, 1] -> (N, 80) features: the Wan VAE's normalized latent mean of each
    image (a one-frame video), average-pooled to 2x2 (16·4 = 64 values: what is where) plus each
    channel's spatial standard deviation (16: how much structure). Frozen, eval mode.

    Args:
        vae: an ``AutoencoderKLWan``; None builds the shipped one (``presets.build_model("wan_vae")``).
    """

    def __init__(self, vae: Optional[nn.Module] = None):
        super().__init__()
        if vae is None:
            from posttrain.modules.models.presets import build_model

            vae = build_model("wan_vae")
        self.vae = vae.eval().requires_grad_(False)
        self.num_features = self.vae.config.z_dim * 5  # read by torchmetrics instead of a dummy forward

    def train(self, mode: bool = True) -> "VAEFrameFeatures":
        return super().train(False)  # a fixed feature network never leaves eval mode

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"VAEFrameFeatures takes (N, 3, H, W) images in [-1, 1]; got {tuple(images.shape)}")
        z = vae_codec.encode(self.vae, images[:, :, None].float())[:, :, 0]  # (N, z, h, w)
        pooled = F.adaptive_avg_pool2d(z, 2).flatten(1)
        return torch.cat([pooled, z.flatten(2).std(-1)], dim=1)


class VideoFrechetDistance(FrechetInceptionDistance):
    """Fréchet distance of video sets, each frame an image: ``update(videos (B, 3, F, H, W) in [-1, 1],
    real: bool)``, ``compute()`` -> scalar. Sums of features and their outer products are the states,
    reduced across processes by torchmetrics.

    Args:
        feature: a module taking (N, 3, H, W) images in [-1, 1] with a ``num_features`` attribute;
            None = ``VAEFrameFeatures()`` on the shipped VAE (a Fréchet VAE distance, not FID).
        reset_real_features: as torchmetrics' FID (False keeps the data's statistics across resets).
    """

    def __init__(self, feature: Optional[nn.Module] = None, reset_real_features: bool = True, **kwargs):
        feature = VAEFrameFeatures() if feature is None else feature
        if not hasattr(feature, "num_features"):
            raise ValueError(f"VideoFrechetDistance: feature {type(feature).__name__} needs a `num_features` "
                             f"attribute (its output width); torchmetrics would otherwise probe it with a "
                             f"299x299 uint8 image")
        super().__init__(feature=feature, reset_real_features=reset_real_features, **kwargs)

    def update(self, videos: torch.Tensor, real: bool) -> None:  # type: ignore[override]
        if videos.ndim != 5 or videos.shape[1] != 3:
            raise ValueError(f"VideoFrechetDistance takes (B, 3, F, H, W) videos in [-1, 1]; got {tuple(videos.shape)}")
        super().update(videos.transpose(1, 2).flatten(0, 1), real)  # (B·F, 3, H, W)
