"""FLUX text-to-image (``FluxPipeline``), and the image VAE of the image generators (``AutoencoderKL``)."""
from __future__ import annotations

import numpy as np
import torch
from diffusers import AutoencoderKL, FluxTransformer2DModel

from posttrain.modules.models.generators.base import (TEXT_DIM, Architecture, Card, GeneratorAdapter, LoraName,
                                                      OriginalLoraNames, VAECodec, _config, _dtype, codec_of)


def clip_pooled_embeds(tokenizer, model: torch.nn.Module, prompts: list[str]) -> torch.Tensor:
    """(B, D) float32 ``CLIPTextModel.pooler_output`` (``FluxPipeline._get_clip_prompt_embeds``: padded to the
    tokenizer's ``model_max_length``, no attention mask), with gradient (pretraining trains the encoder)."""
    ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                    return_tensors="pt").input_ids
    return model(ids.to(next(model.parameters()).device), output_hidden_states=False).pooler_output.float()


def t5_embeds(tokenizer, model: torch.nn.Module, prompts: list[str], max_length: int) -> torch.Tensor:
    """(B, L, D) float32 T5 last hidden states (``FluxPipeline._get_t5_prompt_embeds``: padded to
    ``max_length``, no attention mask, padding not zeroed), with gradient."""
    ids = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True,
                    return_tensors="pt").input_ids
    return model(ids.to(next(model.parameters()).device), output_hidden_states=False)[0].float()


@torch.no_grad()
def clip_pooled(card: Card, encoder: str, prompts: list[str]) -> torch.Tensor:
    return clip_pooled_embeds(card.tokenizers[encoder], card[encoder], prompts)


@torch.no_grad()
def t5_states(card: Card, encoder: str, prompts: list[str]) -> torch.Tensor:
    return t5_embeds(card.tokenizers[encoder], card[encoder], prompts, card.text_max_length)


# The original FLUX.1 checkpoint's module names (Black Forest Labs' ``Flux``; ComfyUI's) of the layers a LoRA can target,
# and their diffusers names: what diffusers' ``_convert_kohya_flux_lora_to_diffusers`` reads (its ComfyUI branch:
# ``diffusion_model.`` keys with lora_down / lora_up), inverted. The original fuses q, k, v (and a single block's MLP
# input) into one layer: their adapters stack on its rows, block-diagonal in lora_up. That converter splits a single
# block's ``linear1`` at FLUX.1's own widths (3072 × 3 + 12288) and reads no ``.alpha`` of the final layer (folded).
_DOUBLE, _SINGLE = r"transformer_blocks\.(\d+)\.", r"single_transformer_blocks\.(\d+)\."
FLUX_LORA_NAMES = OriginalLoraNames(prefix="diffusion_model.", down="lora_down", up="lora_up", names=(
    LoraName(_DOUBLE + r"attn\.to_q", r"double_blocks.\1.img_attn.qkv", part=0, parts=3),
    LoraName(_DOUBLE + r"attn\.to_k", r"double_blocks.\1.img_attn.qkv", part=1, parts=3),
    LoraName(_DOUBLE + r"attn\.to_v", r"double_blocks.\1.img_attn.qkv", part=2, parts=3),
    LoraName(_DOUBLE + r"attn\.to_out\.0", r"double_blocks.\1.img_attn.proj"),
    LoraName(_DOUBLE + r"attn\.add_q_proj", r"double_blocks.\1.txt_attn.qkv", part=0, parts=3),
    LoraName(_DOUBLE + r"attn\.add_k_proj", r"double_blocks.\1.txt_attn.qkv", part=1, parts=3),
    LoraName(_DOUBLE + r"attn\.add_v_proj", r"double_blocks.\1.txt_attn.qkv", part=2, parts=3),
    LoraName(_DOUBLE + r"attn\.to_add_out", r"double_blocks.\1.txt_attn.proj"),
    LoraName(_DOUBLE + r"ff\.net\.0\.proj", r"double_blocks.\1.img_mlp.0"),
    LoraName(_DOUBLE + r"ff\.net\.2", r"double_blocks.\1.img_mlp.2"),
    LoraName(_DOUBLE + r"ff_context\.net\.0\.proj", r"double_blocks.\1.txt_mlp.0"),
    LoraName(_DOUBLE + r"ff_context\.net\.2", r"double_blocks.\1.txt_mlp.2"),
    LoraName(_DOUBLE + r"norm1\.linear", r"double_blocks.\1.img_mod.lin"),
    LoraName(_DOUBLE + r"norm1_context\.linear", r"double_blocks.\1.txt_mod.lin"),
    LoraName(_SINGLE + r"attn\.to_q", r"single_blocks.\1.linear1", part=0, parts=4),
    LoraName(_SINGLE + r"attn\.to_k", r"single_blocks.\1.linear1", part=1, parts=4),
    LoraName(_SINGLE + r"attn\.to_v", r"single_blocks.\1.linear1", part=2, parts=4),
    LoraName(_SINGLE + r"proj_mlp", r"single_blocks.\1.linear1", part=3, parts=4),
    LoraName(_SINGLE + r"proj_out", r"single_blocks.\1.linear2"),
    LoraName(_SINGLE + r"norm\.linear", r"single_blocks.\1.modulation.lin"),
    LoraName(r"x_embedder", "img_in"),
    LoraName(r"context_embedder", "txt_in"),
    LoraName(r"time_text_embed\.timestep_embedder\.linear_1", "time_in.in_layer"),
    LoraName(r"time_text_embed\.timestep_embedder\.linear_2", "time_in.out_layer"),
    LoraName(r"time_text_embed\.text_embedder\.linear_1", "vector_in.in_layer"),
    LoraName(r"time_text_embed\.text_embedder\.linear_2", "vector_in.out_layer"),
    LoraName(r"time_text_embed\.guidance_embedder\.linear_1", "guidance_in.in_layer"),
    LoraName(r"time_text_embed\.guidance_embedder\.linear_2", "guidance_in.out_layer"),
    LoraName(r"norm_out\.linear", "final_layer.adaLN_modulation.1", alpha=False, swap_halves=True),
    LoraName(r"proj_out", "final_layer.linear", alpha=False),
))


class Flux(GeneratorAdapter):
    """FLUX text-to-image (``FluxPipeline``): CLIP's pooled vector and T5's token states as text, 2×2
    patches of the latents packed into tokens with (0, row, column) position ids, the timestep as σ
    (t / 1000), and for guidance-distilled weights (``guidance_embeds``) the embedded guidance value.
    The σ grid is the pipeline's: ``linspace(1, 1/N, N)`` shifted by ``mu`` of the token count."""

    text_encoders = ("text_encoder", "text_encoder_2")
    text_encoder_archs = ("clip", "t5")
    reads = "a CLIP text encoder (pooled) then a T5 encoder"
    original_lora = FLUX_LORA_NAMES
    # what guidance-distilled weights embed unless the stage says otherwise: FluxPipeline's default guidance_scale
    embedded_guidance = 3.5

    def pipeline_class(self):
        # imported on use: the FLUX pipeline module imports transformers' image processors
        from diffusers import FluxPipeline

        return FluxPipeline

    def text(self, stage, prompts):
        if len(stage.encoders) != 2:
            raise ValueError(f"Flux reads two text encoders (CLIP pooled, T5 tokens), got {list(stage.encoders)}")
        clip, t5 = stage.encoders
        card = stage.card
        return {"encoder_hidden_states": card.text_embeds(t5, prompts, lambda missing: t5_states(card, t5, missing)),
                "pooled_projections": card.text_embeds(clip, prompts,
                                                       lambda missing: clip_pooled(card, clip, missing))}

    def extra(self, stage, batch_size):
        if not _config(stage.card[stage.transformer]).guidance_embeds:
            return {}
        value = self.embedded_guidance if stage.embedded_guidance is None else stage.embedded_guidance
        return {"guidance": torch.full((batch_size,), float(value))}

    @staticmethod
    def pack(x: torch.Tensor) -> torch.Tensor:
        """(B, C, 1, h, w) -> (B, h/2·w/2, 4C) tokens (``FluxPipeline._pack_latents``)."""
        B, C, _, h, w = x.shape
        return x[:, :, 0].reshape(B, C, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, (h // 2) * (w // 2), 4 * C)

    @staticmethod
    def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """(B, h/2·w/2, 4C) -> (B, C, 1, h, w) (``FluxPipeline._unpack_latents``)."""
        B, _, D = tokens.shape
        x = tokens.reshape(B, h // 2, w // 2, D // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(B, D // 4, h, w)[:, :, None]

    def velocity(self, transformer, x, timestep, cond):
        dtype = _dtype(transformer)
        h, w = x.shape[-2:]
        # (h/2·w/2, 3) position ids of the packed 2x2 latent tokens
        img_ids = self.pipeline_class()._prepare_latent_image_ids(x.shape[0], h // 2, w // 2, x.device, dtype)
        text = cond["encoder_hidden_states"]
        txt_ids = torch.zeros(text.shape[1], 3, device=x.device, dtype=dtype)  # FluxPipeline.encode_prompt
        guidance = cond.get("guidance")
        v = transformer(hidden_states=self.pack(x).to(dtype), timestep=(timestep / 1000).to(dtype),
                        guidance=None if guidance is None else guidance.to(x.device, torch.float32),
                        pooled_projections=cond["pooled_projections"].to(dtype), encoder_hidden_states=text.to(dtype),
                        txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        return self.unpack(v, h, w)

    def pipeline_call(self, serving):
        # FluxPipeline's `guidance_scale` is the embedded guidance; classifier-free guidance is `true_cfg_scale`
        # with a negative prompt (the empty prompt, as here)
        cfg, embedded = serving["guidance_scale"], serving.get("embedded_guidance")
        call = {"num_inference_steps": serving["num_inference_steps"], "max_sequence_length": serving["max_sequence_length"],
                "height": serving["height"], "width": serving["width"],
                "guidance_scale": self.embedded_guidance if embedded is None else embedded}
        return call | ({"true_cfg_scale": cfg, "negative_prompt": ""} if cfg != 1.0 else {})

    def latent_shape(self, transformer, vae, size):
        if size.frames != 1:
            raise ValueError(f"video size: frames={size.frames}, but FLUX makes images: set frames: 1")
        # the latents are packed in 2×2 patches: H and W multiples of 2 × the VAE's factor (FluxPipeline.check_inputs)
        return codec_of(vae).latent_shape(vae, 1, size.height, size.width, patch=(2, 2))

    def training_inputs(self, config, forward):
        # FluxPipeline's packed 2x2 latent tokens, T5 states, CLIP pooled, position ids
        _, _, h, w = forward.latent_shape
        tokens, length, rows = (h // 2) * (w // 2), forward.text_length, forward.rows
        shapes = dict(hidden_states=(rows, tokens, config["in_channels"]), timestep=(rows,),
                      encoder_hidden_states=(rows, length, config["joint_attention_dim"]),
                      pooled_projections=(rows, config["pooled_projection_dim"]), img_ids=(tokens, 3),
                      txt_ids=(length, 3))
        if config.get("guidance_embeds"):
            shapes["guidance"] = (rows,)
        return shapes

    def attention_tokens(self, config, shapes):
        # the packed image tokens and the text, attended jointly
        return shapes["hidden_states"][1] + shapes["encoder_hidden_states"][1]

    def schedule_kwargs(self, sampler, latent_shape):
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        n = sampler.num_steps
        config = sampler.scheduler.config
        sigmas = None if config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / n, n)
        mu = calculate_shift((latent_shape[-2] // 2) * (latent_shape[-1] // 2), config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        return {"sigmas": sigmas, "mu": mu}


class ImageVAE(VAECodec):
    """``AutoencoderKL`` as the image pipelines use it (``FluxPipeline``, ``StableDiffusion3Pipeline``): each frame
    an image, normalized by ``(z - shift_factor)·scaling_factor``."""

    def encode(self, vae, video, sample=False, generator=None):
        frames = video.to(_dtype(vae)).permute(0, 2, 1, 3, 4).flatten(0, 1)  # (B·F, C, H, W)
        dist = vae.encode(frames).latent_dist
        z = (dist.sample(generator) if sample else dist.mode()).float()
        z = (z - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor
        return z.unflatten(0, (video.shape[0], video.shape[2])).permute(0, 2, 1, 3, 4)

    def decode(self, vae, latents):
        z = latents.permute(0, 2, 1, 3, 4).flatten(0, 1).float()
        z = z / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        frames = vae.decode(z.to(_dtype(vae)), return_dict=False)[0].float().clamp(-1, 1)
        return frames.unflatten(0, (latents.shape[0], latents.shape[2])).permute(0, 2, 1, 3, 4)

    def scale_factors(self, vae):
        return 1, 2 ** (len(vae.config.block_out_channels) - 1)  # as the pipelines read it: each level but the last

    def latent_channels(self, vae):
        return vae.config.latent_channels


ARCHITECTURES = {
    # AutoencoderKL of the image generators (FLUX, SD3): 4x spatial (three levels; the pipelines read 2^(levels-1)
    # from the config), 16 latent channels; normalized by (z - shift_factor)·scaling_factor. Asset:
    # scripts/train_flux_vae.py.
    "vae_kl": Architecture(AutoencoderKL, dict(
        block_out_channels=(16, 32, 32), latent_channels=16, norm_num_groups=8, layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        shift_factor=0.0, scaling_factor=1.0,
    ), "vae", codec=ImageVAE(), asset=True),
    # FLUX text-to-image, 0.47M parameters: 2×2 packed latents of the 16-channel image VAE (``vae_kl``) in (64),
    # T5 tokens (joint_attention_dim) and CLIP's pooled vector (pooled_projection_dim) as text; RoPE axes sum to the
    # head dim. A 32 px image is 8×8 latents, 16 tokens. The shipped asset: scripts/train_flux.py.
    "flux": Architecture(FluxTransformer2DModel, dict(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=32,
        num_attention_heads=2, joint_attention_dim=TEXT_DIM, pooled_projection_dim=TEXT_DIM,
        axes_dims_rope=(8, 12, 12),
    ), "generator", adapter=Flux(), asset=True, layer_keys=("num_layers", "num_single_layers")),
}
