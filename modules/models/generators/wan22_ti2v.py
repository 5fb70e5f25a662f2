"""Wan 2.2 TI2V-5B: one transformer for text-to-video and image-to-video (``WanPipeline`` and
``WanImageToVideoPipeline``, both with ``expand_timesteps=True``), over the Wan 2.2 VAE.

The Wan 2.2 VAE is ``AutoencoderKLWan`` with ``patch_size=2`` (pixels folded 2x2 into 12 channels before its
convolutions), ``is_residual=True``, 48 latent channels and 16x spatial compression; ``wan.WanVAE`` already encodes,
normalizes (its own 48 ``latents_mean``/``latents_std``) and decodes it, and reads the 16x from its layers.

The transformer reads the latents as they are (48 channels in, no mask channels, no CLIP image encoder) and one
timestep per token (``expand_timesteps``: (B, F'·h/2·w/2)). Image-to-video is the same call with the first latent
frame replaced by the VAE latents of the image alone and its tokens at timestep 0
(``WanImageToVideoPipeline.prepare_latents``; ``latent_model_input = (1 - first_frame_mask) * condition +
first_frame_mask * latents``). So one set of weights does both, as the published folder is loaded by either
pipeline; what a card's ``arch`` chooses is what the methods do with a batch:

| arch | the methods | export |
|---|---|---|
| ``wan22_ti2v`` | text-to-video from the prompt | ``WanPipeline(expand_timesteps=True)`` |
| ``wan22_ti2v_i2v`` | image-to-video from each row's first frame (the batch's ``image``, its video's first frame, or its precomputed latents' first latent frame) | ``WanImageToVideoPipeline(expand_timesteps=True)`` |

Called directly, either adapter conditions on an image when one is given (``stage.condition(prompts,
images=..., size=...)``) and on the text alone otherwise.

Image-to-video keeps the first frame clean everywhere a model is run:

- the velocity of the first frame is the flow's velocity given that its clean value is the image's latents ``c``:
  ``(x_σ - c)/σ`` — no function of the weights, so finetuning regresses the generated frames only (the pipeline
  never reads the transformer's output there), and ``x̂0 = x_σ - σ·v`` is ``c`` on it;
- the sampler holds it at ``c`` at every step (``clean_latents``, ``samplers.CleanLatents``): the ODE, and the SDE
  whose log-probability is the density of the generated frames alone (FlowGRPO's PPO ratio and its parity check).
"""
from __future__ import annotations

from typing import Optional

import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel

from posttrain.modules.flow.conditioning import Conditioning
from posttrain.modules.flow.samplers import CleanLatents
from posttrain.modules.models.generators.base import TEXT_DIM, Architecture, _config, _dtype, codec_of
from posttrain.modules.models.generators.wan import _WAN_BLOCKS, WAN_T2V, WanT2V, WanVAE, _image_batch

# The Wan 2.2 VAE's per-channel latent statistics (Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json; diffusers'
# scripts/convert_wan_to_diffusers.py vae22_diffusers_config): what its 48 latent channels are normalized by
WAN22_LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667]
WAN22_LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744]

# The scheduler's training timesteps: the transformer reads t = σ · 1000 (every Wan scheduler's num_train_timesteps)
NUM_TRAIN_TIMESTEPS = 1000


class WanTI2V(WanT2V):
    """Wan 2.2 TI2V-5B (``WanPipeline`` / ``WanImageToVideoPipeline`` with ``expand_timesteps=True``): UMT5 hidden
    states as Wan T2V's, one timestep per token, and for image-to-video ``first_frame_latents`` (B, C, 1, h, w): the
    normalized VAE latents of the image alone, written over the first latent frame.

    Args:
        takes_image: the methods condition every row on its first frame and export writes
            ``WanImageToVideoPipeline`` (``arch: wan22_ti2v_i2v``); else text-to-video and ``WanPipeline``.
    """

    def __init__(self, takes_image: bool):
        self.takes_image = takes_image

    def pipeline_class(self):
        from diffusers import WanImageToVideoPipeline, WanPipeline

        return WanImageToVideoPipeline if self.takes_image else WanPipeline

    def pipeline(self, components):
        return self.pipeline_class()(**components, expand_timesteps=True)

    def image(self, stage, images, size):
        vae = stage.card[stage.vae]
        images = _image_batch(images, size, type(self).__name__)
        # the image alone through the VAE (prepare_latents' ``video_condition = image`` under expand_timesteps): one
        # latent frame, normalized as the pipeline does
        with torch.no_grad():
            latents = codec_of(vae).encode(vae, images[:, :, None])  # (B, C, 1, h, w)
        return {"first_frame_latents": latents}

    def image_from_latents(self, stage, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        """The image part of the conditioning read off a clip's clean latents (B, C, F', h, w), for batches that carry
        precomputed ``latents`` and no pixels (a ``latents_cache``, ``PrecomputedVideos``): their first latent frame.
        The Wan VAEs are causal in time (the encoder runs the first pixel frame alone, then chunks of 4 on a cache of
        the past), so that frame is what ``image`` encodes from the first pixel frame: bit for bit at the same batch
        size, float32 CPU (at another, the convolutions' rounding: 4.8e-7; ``tests/test_wan22_ti2v.py``)."""
        if latents.ndim != 5:
            raise ValueError(f"{type(self).__name__}: precomputed latents must be (B, C, F', h, w); got shape "
                             f"{tuple(latents.shape)}")
        return {"first_frame_latents": latents[:, :, :1].float()}

    def clean_latents(self, cond: Conditioning, latent_shape: tuple[int, ...]) -> Optional[CleanLatents]:
        first = cond.get("first_frame_latents")
        if first is None:
            return None
        mask = torch.zeros(1, 1, latent_shape[1], 1, 1, dtype=torch.bool, device=first.device)
        mask[:, :, 0] = True
        return CleanLatents(mask=mask, latents=first.float())

    def velocity(self, transformer, x, timestep, cond):
        """(B, C, F', h, w) velocity; ``timestep`` (B,) or () as the sampler gives it, expanded to the tokens."""
        dtype = _dtype(transformer)
        B, _, frames, height, width = x.shape
        p_t, p_h, p_w = _config(transformer).patch_size
        t = timestep.to(x.device, torch.float32).reshape(-1).expand(B)
        frame_t = t[:, None].expand(B, frames // p_t)  # one timestep per latent frame: first_frame_mask · t
        first = cond.get("first_frame_latents")
        hidden = x
        if first is not None:  # the image's latents over the first frame, its tokens at timestep 0
            hidden = torch.cat([first.to(x), x[:, :, 1:]], dim=2)
            frame_t = torch.cat([torch.zeros_like(frame_t[:, :1]), frame_t[:, 1:]], dim=1)
        # (B, F'·h/2·w/2): tokens are frame-major, then rows, then columns, as patch_embedding flattens them (the
        # pipeline's ``(first_frame_mask[0][0][:, ::2, ::2] * t).flatten()``)
        tokens = frame_t.repeat_interleave((height // p_h) * (width // p_w), dim=1)
        v = transformer(hidden_states=hidden.to(dtype), timestep=tokens,
                        encoder_hidden_states=cond["encoder_hidden_states"].to(dtype), return_dict=False)[0]
        if first is None:
            return v
        # the clean first frame's velocity given its x0 = c: (x_σ - c)/σ, 0 at σ = 0; the weights do not enter it
        sigma = (t / NUM_TRAIN_TIMESTEPS).view(B, 1, 1, 1, 1)
        offset = x[:, :, :1].float() - first.float()
        v_first = torch.where(sigma > 0, offset / sigma.clamp_min(1e-12), torch.zeros_like(offset))
        return torch.cat([v_first, v[:, :, 1:].float()], dim=2)

    def latent_shape(self, transformer, vae, size):
        patch = tuple(_config(transformer).patch_size)
        if patch != (1, 2, 2):  # WanPipeline/WanImageToVideoPipeline build token timesteps from [:, ::2, ::2]
            raise ValueError(f"{type(self).__name__}: the transformer's patch_size is {list(patch)}, but the TI2V "
                             f"pipelines' per-token timesteps assume [1, 2, 2]: drop patch_size from its preset")
        return super().latent_shape(transformer, vae, size)

    def training_inputs(self, config, forward):
        shapes = super().training_inputs(config, forward)
        _, f, h, w = forward.latent_shape
        patch = config["patch_size"]
        return {**shapes, "timestep": (forward.rows, (f // patch[0]) * (h // patch[1]) * (w // patch[2]))}


# WanTransformer3DModel of TI2V-5B's layout at the size of the world's Wan (``wan.WAN_T2V``: four blocks of four 32-wide
# heads, 1.2M parameters): 48 latent channels in and out, patch (1, 2, 2) (the pipelines' ``[:, ::2, ::2]`` token
# timesteps assume it). A 5 x 32 x 32 clip of the world is 2 x 4 x 4 latents, 2 x 2 x 2 = 8 tokens. The shipped
# asset (``scripts/train_ti2v.py``) is exactly this, pretrained on the world for both tasks.
WAN22_TI2V = dict(WAN_T2V, in_channels=48, out_channels=48)
ARCHITECTURES = {
    # The Wan 2.2 VAE's layout (residual blocks, 2x2 pixel patches into 12 channels, 48 latent channels, 4x temporal,
    # a decoder wider than the encoder: the published 256 and 160) at the world's scale: widths 32 and 16 and three
    # levels (the published four), so 8x spatial where the published VAE is 16x, as the world's Wan 2.1 VAE is 4x where
    # the published is 8x (a 32 px frame is 4 x 4 latents, 2 x 2 tokens). 0.5M parameters. The shipped asset
    # (``scripts/train_vae.py --arch wan22_vae``) is exactly this, its latent statistics measured on the world (the
    # preset's are the published VAE's, for random builds).
    "wan22_vae": Architecture(AutoencoderKLWan, dict(
        base_dim=16, decoder_base_dim=32, z_dim=48, dim_mult=[1, 1, 1], num_res_blocks=0,
        temperal_downsample=[True, True],
        is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=8,
        scale_factor_temporal=4, latents_mean=WAN22_LATENTS_MEAN, latents_std=WAN22_LATENTS_STD,
    ), "vae", codec=WanVAE(), asset=True),
    # one transformer, two tasks: the same class, preset and state dict (a checkpoint of either loads as the other)
    "wan22_ti2v": Architecture(WanTransformer3DModel, WAN22_TI2V, "generator", adapter=WanTI2V(takes_image=False),
                               asset=True, layer_keys=("num_layers",), **_WAN_BLOCKS),
    "wan22_ti2v_i2v": Architecture(WanTransformer3DModel, dict(WAN22_TI2V), "generator",
                                   adapter=WanTI2V(takes_image=True), asset="wan22_ti2v", layer_keys=("num_layers",),
                                   **_WAN_BLOCKS),
}
