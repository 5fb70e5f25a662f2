"""Wan 2.1 / 2.2 text-to-video and image-to-video (``WanPipeline``, ``WanImageToVideoPipeline``), the
block-causal Wan student of Self-Forcing (``modules.models.causal_wan``), and Wan's VAE (``AutoencoderKLWan``)."""
from __future__ import annotations

import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from diffusers.pipelines.wan.pipeline_wan import prompt_clean

from posttrain.modules.models.causal_wan import CausalWanTransformer3DModel
from posttrain.modules.models.generators.base import (TEXT_DIM, Architecture, Card, GeneratorAdapter, LoraName,
                                                      OriginalLoraNames, Stage, VAECodec, VideoSize, _config, _dtype,
                                                      codec_of)


def wan_tokens(tokenizer, prompts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, max_length) ids and attention mask as ``WanPipeline._get_t5_prompt_embeds`` makes them: the prompt
    cleaned, padded to ``max_length``, special tokens added."""
    tokens = tokenizer([prompt_clean(p) for p in prompts], padding="max_length", max_length=max_length,
                       truncation=True, add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    return tokens.input_ids, tokens.attention_mask


def wan_text_states(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, L, D) last hidden states in the encoder's dtype, zero after each prompt's tokens; with grad (a
    script that trains the text encoder with the generator backs up through it)."""
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    hidden = model(ids, mask).last_hidden_state
    return hidden * mask.unsqueeze(-1).to(hidden.dtype)


@torch.no_grad()
def umt5_embeds(card: Card, encoder: str, prompts: list[str]) -> torch.Tensor:
    """``wan_text_states`` of ``wan_tokens`` of a card's frozen encoder (the pipeline's prompt embeddings)."""
    return wan_text_states(card[encoder], *wan_tokens(card.tokenizers[encoder], prompts, card.text_max_length))


# The original Wan 2.1 checkpoint's module names (the Wan repository's ``WanModel``; ComfyUI's) of the layers a LoRA can
# target, and their diffusers names: what diffusers' ``_convert_non_diffusers_wan_lora_to_diffusers`` reads, inverted.
# That converter reads ``.alpha`` inside the blocks only; elsewhere the scale is folded into lora_B. ``patch_embedding``
# (a Conv3d) keeps its name; ComfyUI reads it, diffusers' converter does not.
WAN_LORA_NAMES = OriginalLoraNames(prefix="diffusion_model.", down="lora_A", up="lora_B", names=(
    LoraName(r"blocks\.(\d+)\.attn1\.to_q", r"blocks.\1.self_attn.q"),
    LoraName(r"blocks\.(\d+)\.attn1\.to_k", r"blocks.\1.self_attn.k"),
    LoraName(r"blocks\.(\d+)\.attn1\.to_v", r"blocks.\1.self_attn.v"),
    LoraName(r"blocks\.(\d+)\.attn1\.to_out\.0", r"blocks.\1.self_attn.o"),
    LoraName(r"blocks\.(\d+)\.attn2\.to_q", r"blocks.\1.cross_attn.q"),
    LoraName(r"blocks\.(\d+)\.attn2\.to_k", r"blocks.\1.cross_attn.k"),
    LoraName(r"blocks\.(\d+)\.attn2\.to_v", r"blocks.\1.cross_attn.v"),
    LoraName(r"blocks\.(\d+)\.attn2\.to_out\.0", r"blocks.\1.cross_attn.o"),
    LoraName(r"blocks\.(\d+)\.attn2\.add_k_proj", r"blocks.\1.cross_attn.k_img"),  # Wan 2.1 I2V: the image tokens
    LoraName(r"blocks\.(\d+)\.attn2\.add_v_proj", r"blocks.\1.cross_attn.v_img"),
    LoraName(r"blocks\.(\d+)\.ffn\.net\.0\.proj", r"blocks.\1.ffn.0"),
    LoraName(r"blocks\.(\d+)\.ffn\.net\.2", r"blocks.\1.ffn.2"),
    LoraName(r"condition_embedder\.text_embedder\.linear_1", "text_embedding.0", alpha=False),
    LoraName(r"condition_embedder\.text_embedder\.linear_2", "text_embedding.2", alpha=False),
    LoraName(r"condition_embedder\.time_embedder\.linear_1", "time_embedding.0", alpha=False),
    LoraName(r"condition_embedder\.time_embedder\.linear_2", "time_embedding.2", alpha=False),
    LoraName(r"condition_embedder\.time_proj", "time_projection.1", alpha=False),
    LoraName(r"condition_embedder\.image_embedder\.ff\.net\.0\.proj", "img_emb.proj.1", alpha=False),
    LoraName(r"condition_embedder\.image_embedder\.ff\.net\.2", "img_emb.proj.3", alpha=False),
    LoraName(r"proj_out", "head.head", alpha=False),
    LoraName(r"patch_embedding", "patch_embedding"),
))


class WanT2V(GeneratorAdapter):
    """Wan 2.1 text-to-video (``WanPipeline``): UMT5 hidden states, zero beyond each prompt's tokens.

    Also drives the block-causal student (``arch: wan_t2v_causal``, ``modules.causal_wan``): the same call
    plus its ``kv_cache``/``update_cache`` keywords. With a cache the input is exactly one chunk, so the
    chunk size of the call is the input's frame count.
    """

    text_encoder_archs = ("umt5",)
    reads = "a UMT5 text encoder"
    original_lora = WAN_LORA_NAMES

    def pipeline_class(self):
        from diffusers import WanPipeline

        return WanPipeline

    def text(self, stage, prompts):
        (encoder,) = stage.encoders
        card = stage.card
        return {"encoder_hidden_states": card.text_embeds(encoder, prompts,
                                                          lambda missing: umt5_embeds(card, encoder, missing))}

    def text_encoder_problems(self, stage, archs):
        return []  # the pipeline's UMT5, or any encoder whose last hidden states have the transformer's text_dim

    def velocity(self, transformer, x, timestep, cond, **model_kwargs):
        dtype = _dtype(transformer)
        if model_kwargs.get("kv_cache") is not None:
            model_kwargs = {**model_kwargs, "num_frames_per_chunk": x.shape[2]}
        return transformer(hidden_states=x.to(dtype), timestep=timestep,
                           encoder_hidden_states=cond["encoder_hidden_states"].to(dtype), return_dict=False,
                           **model_kwargs)[0]

    def latent_shape(self, transformer, vae, size):
        patch = _config(transformer).patch_size
        return codec_of(vae).latent_shape(vae, size.frames, size.height, size.width, patch=(patch[1], patch[2]))

    def training_inputs(self, config, forward):
        _, f, h, w = forward.latent_shape  # an I2V transformer's in_channels count the image latents and mask too
        return dict(hidden_states=(forward.rows, config["in_channels"], f, h, w), timestep=(forward.rows,),
                    encoder_hidden_states=(forward.rows, forward.text_length, config["text_dim"]))

    def attention_tokens(self, config, shapes):
        # self-attention runs over the patches of the latent video (the text is cross-attended)
        patch = config["patch_size"]
        _, _, f, h, w = shapes["hidden_states"]
        return (f // patch[0]) * (h // patch[1]) * (w // patch[2])


class WanI2V(WanT2V):
    """Wan image-to-video (``WanImageToVideoPipeline``, ``expand_timesteps=False``): the transformer reads
    the noisy latents concatenated on channels with a first-frame mask and the VAE latents of the video
    ``[image, 0, …, 0]`` (``prepare_latents``), plus the prompt's UMT5 states. The Wan 2.2-style layout
    (``in_channels = 2C + T``, no image encoder) is the default; a transformer with ``image_dim`` (Wan 2.1)
    also reads the penultimate hidden states of the card's CLIP vision ``image_encoder`` (``encode_image``)."""

    takes_image = True

    def pipeline_class(self):
        from diffusers import WanImageToVideoPipeline

        return WanImageToVideoPipeline

    def image(self, stage, images, size):
        vae = stage.card[stage.vae]
        images = _image_batch(images, size, type(self).__name__)
        codec = codec_of(vae)
        temporal, _ = codec.scale_factors(vae)
        # 1. the conditioning video: the image, then F-1 zero (mid-grey) frames, through the VAE
        B, _, H, W = images.shape
        video = torch.cat([images[:, :, None], images.new_zeros(B, 3, size.frames - 1, H, W)], dim=2)
        with torch.no_grad():
            latents = codec.encode(vae, video)  # (B, C, F', h, w), normalized as the pipeline does
        # 2. the mask: 1 on the first pixel frame, 0 after; the first latent frame holds T pixel frames, so the
        #    mask's F pixel frames are regrouped into T channels per latent frame: (B, T, F', h, w)
        h, w = latents.shape[-2:]
        mask = torch.zeros(B, 1, size.frames, h, w, device=latents.device)
        mask[:, :, 0] = 1
        mask = torch.cat([mask[:, :, :1].repeat_interleave(temporal, dim=2), mask[:, :, 1:]], dim=2)
        mask = mask.view(B, -1, temporal, h, w).transpose(1, 2)
        out = {"image_latents": torch.cat([mask, latents], dim=1)}
        if _config(stage.card[stage.transformer]).image_dim is not None:
            out["encoder_hidden_states_image"] = clip_image_states(stage, images)
        return out

    def pipeline_components(self, transformer, vae, text_encoders, image_encoder=None):
        components = super().pipeline_components(transformer, vae, text_encoders)
        if image_encoder is not None:  # Wan 2.1: the CLIP vision encoder and its processor
            components["image_encoder"] = image_encoder
            components["image_processor"] = wan21_image_processor(image_encoder)
        return components

    def velocity(self, transformer, x, timestep, cond):
        dtype = _dtype(transformer)
        image = cond.get("encoder_hidden_states_image")
        return transformer(hidden_states=torch.cat([x, cond["image_latents"]], dim=1).to(dtype), timestep=timestep,
                           encoder_hidden_states=cond["encoder_hidden_states"].to(dtype),
                           encoder_hidden_states_image=None if image is None else image.to(dtype),
                           return_dict=False)[0]


def wan21_image_processor(image_encoder: torch.nn.Module):
    """The ``CLIPImageProcessor`` of a CLIP vision encoder (resize and crop to its ``image_size``, CLIP's
    mean/std), built offline; export writes it as the pipeline's ``image_processor``."""
    from transformers import CLIPImageProcessor

    size = int(_config(image_encoder).image_size)
    return CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


@torch.no_grad()
def clip_image_states(stage: Stage, images: torch.Tensor) -> torch.Tensor:
    """(B, N, D) penultimate hidden states of the stage's image encoder (``WanImageToVideoPipeline.encode_image``)
    for ``images`` (B, 3, H, W) in [-1, 1]. The processor gets them as 8-bit (H, W, 3) arrays, as it gets the
    PIL images a pipeline is called with (its resize and 1/255 rescale then agree exactly)."""
    encoder = stage.card[stage.image_encoder]
    processor = wan21_image_processor(encoder)
    eight_bit = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    pixels = processor(images=list(eight_bit), return_tensors="pt").pixel_values
    device = next(encoder.parameters()).device
    return encoder(pixel_values=pixels.to(device, _dtype(encoder)), output_hidden_states=True).hidden_states[-2].float()


def _image_batch(images: torch.Tensor, size: VideoSize, who: str) -> torch.Tensor:
    """``images`` as (B, 3, H, W) float32, checked against ``size`` (a (B, 3, 1, H, W) image is accepted)."""
    if images.ndim == 5 and images.shape[2] == 1:
        images = images[:, :, 0]
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"{who}: conditioning images must be (B, 3, H, W) in [-1, 1]; got shape {tuple(images.shape)}")
    if tuple(images.shape[-2:]) != (size.height, size.width):
        raise ValueError(f"{who}: conditioning images are {images.shape[-2]}x{images.shape[-1]} px but the video is "
                         f"{size.height}x{size.width}: make the image stage's height/width equal the video's")
    return images.float()


class WanVAE(VAECodec):
    """``AutoencoderKLWan`` as ``WanPipeline`` uses it: video in, video latents out, normalized per channel by the
    config's ``latents_mean``/``latents_std``."""

    @staticmethod
    def _stats(vae: AutoencoderKLWan, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=like.device, dtype=torch.float32).view(shape)
        std = torch.tensor(vae.config.latents_std, device=like.device, dtype=torch.float32).view(shape)
        return mean, std

    def encode(self, vae, video, sample=False, generator=None):
        dist = vae.encode(video.to(_dtype(vae))).latent_dist
        z = (dist.sample(generator) if sample else dist.mode()).float()
        mean, std = self._stats(vae, z)
        return (z - mean) / std

    def decode(self, vae, latents):
        mean, std = self._stats(vae, latents)
        video = vae.decode((latents.float() * std + mean).to(_dtype(vae)), return_dict=False)[0]
        return video.float().clamp(-1, 1)

    def scale_factors(self, vae):
        """A Wan VAE's ``scale_factor_*`` are plain config values beside the layers that do the compressing: one that
        disagrees with its ``dim_mult`` / ``temperal_downsample`` is an error here (latents of the wrong size
        otherwise)."""
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

    def latent_channels(self, vae):
        return vae.config.z_dim

    def preset(self, config, given):
        """The ``scale_factor_*`` follow the merged layers unless ``given`` (the user's part) sets them: a preset of
        Wan2.1's 8x VAE over the world's 4x one builds an 8x VAE."""
        temporal, spatial = wan_compression(config)
        return {**config, "scale_factor_temporal": given.get("scale_factor_temporal", temporal),
                "scale_factor_spatial": given.get("scale_factor_spatial", spatial)}


def wan_compression(config) -> tuple[int, int]:
    """(temporal, spatial) compression that an ``AutoencoderKLWan`` of ``config`` (its config or a preset)
    builds: each level but the last halves height and width, the levels marked in ``temperal_downsample`` time;
    Wan 2.2's ``patch_size`` folds a further factor into the channels."""
    patch = config.get("patch_size") or 1  # a diffusers config is a dict too (FrozenDict)
    return 2 ** sum(bool(t) for t in config["temperal_downsample"]), 2 ** (len(config["dim_mult"]) - 1) * patch


# WanTransformer3DModel, 1.2M parameters; patch (1,2,2) on the 4x VAE's latents: a 5x32x32 video is 2x4x4 = 32
# tokens. text_dim matches the UMT5's d_model. Without overrides it loads the shipped asset (scripts/train_world.py),
# trained jointly with that UMT5.
WAN_T2V = dict(
    patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=16,
    out_channels=16, text_dim=TEXT_DIM, freq_dim=64, ffn_dim=512, num_layers=4,
    qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
)
_T2V = WanT2V()  # one adapter for both: the block-causal Wan is driven like Wan T2V
# a Wan block's three residual branches: self-attention, cross-attention and the feed-forward (block expansion);
# its width: more heads of the same head size, a wider feed-forward (widening)
_WAN_BLOCKS = dict(blocks="blocks", residual_outputs=("attn1.to_out.0", "attn2.to_out.0", "ffn.net.2"),
                   widths=("num_attention_heads", "ffn_dim"),
                   hidden_size=lambda config: config["num_attention_heads"] * config["attention_head_dim"])
ARCHITECTURES = {
    # AutoencoderKLWan: 4x spatial (three levels), 4x temporal ((F-1)/4+1 latent frames), 16 latent channels,
    # encoder and decoder of width 16 (0.13M parameters). The shipped asset (scripts/train_vae.py) is exactly this.
    "wan_vae": Architecture(AutoencoderKLWan, dict(
        base_dim=16, z_dim=16, dim_mult=[1, 1, 1], num_res_blocks=0, temperal_downsample=[True, True],
        scale_factor_spatial=4, scale_factor_temporal=4,
    ), "vae", codec=WanVAE(), asset=True),
    "wan_t2v": Architecture(WanTransformer3DModel, WAN_T2V, "generator", adapter=_T2V, asset=True,
                            layer_keys=("num_layers",), **_WAN_BLOCKS),
    # The block-causal student (CausalWanTransformer3DModel, Self-Forcing): Wan T2V's config and state dict
    # (``init_from: teacher`` copies the pretrained world's generator into it).
    "wan_t2v_causal": Architecture(CausalWanTransformer3DModel, dict(WAN_T2V), "generator", adapter=_T2V,
                                   causal=True, layer_keys=("num_layers",), **_WAN_BLOCKS),
    # Wan 2.2-style image-to-video (``WanImageToVideoPipeline`` without an image encoder): noisy latent (16) +
    # first-frame mask (4, the VAE's temporal factor) + image latents (16) channels in. The Wan 2.1 layout adds
    # ``image_dim`` and ``added_kv_proj_dim`` (a CLIP vision encoder's tokens; see ``clip_vision``). The world's I2V
    # generator has the world's T2V dimensions (1.2M parameters; scripts/train_i2v.py starts it from their weights).
    "wan_i2v": Architecture(WanTransformer3DModel, dict(WAN_T2V, in_channels=36), "generator", adapter=WanI2V(),
                            asset=True, layer_keys=("num_layers",), **_WAN_BLOCKS),
}
