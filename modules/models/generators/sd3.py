"""Stable Diffusion 3 text-to-image (``StableDiffusion3Pipeline``): Flow-GRPO's original setting.

An MMDiT (``SD3Transformer2DModel``) over the 16-channel image VAE's latents (the shipped ``vae_kl``), reading two
CLIP text encoders with projection (``CLIPTextModelWithProjection``: penultimate hidden states and the projected
pooled vector) and a T5 encoder, combined as ``StableDiffusion3Pipeline.encode_prompt`` does: the two CLIPs' token
states concatenated on features and zero-padded to T5's width, T5's tokens after them; the two pooled vectors
concatenated. Flow matching on the scheduler's σ grid (``FlowMatchEulerDiscreteScheduler``, shift 3), the
timestep is 1000·σ. Latents stay (B, C, 1, h, w) as every adapter keeps them; the transformer runs on (B, C, h, w).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers import SD3Transformer2DModel
from transformers import CLIPTextModelWithProjection

from posttrain.modules.models.generators.base import (BYT5_VOCAB, TEXT_DIM, Architecture, Card, GeneratorAdapter,
                                                      _config, _dtype, codec_of)
from posttrain.modules.models.generators.flux import t5_states


def clip_rows(tokenizer, model: torch.nn.Module, prompts: list[str]) -> torch.Tensor:
    """(B, L·D + P) rows of a ``CLIPTextModelWithProjection`` as ``StableDiffusion3Pipeline._get_clip_prompt_embeds``
    computes them (padded to the tokenizer's ``model_max_length``, no attention mask): the penultimate hidden
    states (B, L, D) flattened, then the projected pooled vector (B, P); one row per prompt, so that the card's
    prompt cache keeps both (``clip_split`` takes them apart)."""
    ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                    return_tensors="pt").input_ids
    out = model(ids.to(next(model.parameters()).device), output_hidden_states=True)
    return torch.cat([out.hidden_states[-2].flatten(1), out.text_embeds], dim=1)


def clip_split(rows: torch.Tensor, model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``clip_rows`` as (B, L, D) hidden states and (B, P) pooled vectors."""
    width = _config(model).hidden_size
    states = rows.shape[1] - _config(model).projection_dim
    return rows[:, :states].unflatten(1, (states // width, width)), rows[:, states:]


@torch.no_grad()
def _clip(card: Card, encoder: str, prompts: list[str]) -> torch.Tensor:
    return clip_rows(card.tokenizers[encoder], card[encoder], prompts)


class SD3(GeneratorAdapter):
    """Stable Diffusion 3 (``StableDiffusion3Pipeline``): ``encoder_hidden_states`` (B, L_clip + L_t5, D_t5) and
    ``pooled_projections`` (B, P_1 + P_2) from two CLIPs and a T5, the transformer's patchified latents, a fixed
    shift."""

    text_encoders = ("text_encoder", "text_encoder_2", "text_encoder_3")
    text_encoder_archs = ("clip_projection", "clip_projection", "t5")
    reads = "two CLIP text encoders with projection, then a T5 encoder"

    def pipeline_class(self):
        # imported on use: the pipeline module imports transformers' image processors
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline

    def text(self, stage, prompts):
        card = stage.card
        *clips, t5 = stage.encoders
        states, pooled = zip(*(clip_split(card.text_embeds(name, prompts, lambda missing, name=name: _clip(
            card, name, missing)), card[name]) for name in clips))
        tokens = card.text_embeds(t5, prompts, lambda missing: t5_states(card, t5, missing))
        clip = torch.cat(states, dim=-1).to(tokens.dtype)
        clip = F.pad(clip, (0, tokens.shape[-1] - clip.shape[-1]))  # to T5's width
        return {"encoder_hidden_states": torch.cat([clip, tokens], dim=-2), "pooled_projections": torch.cat(pooled, -1)}

    def velocity(self, transformer, x, timestep, cond):
        dtype = _dtype(transformer)
        v = transformer(hidden_states=x[:, :, 0].to(dtype), timestep=timestep,
                        encoder_hidden_states=cond["encoder_hidden_states"].to(dtype),
                        pooled_projections=cond["pooled_projections"].to(dtype), return_dict=False)[0]
        return v[:, :, None]

    def latent_shape(self, transformer, vae, size):
        if size.frames != 1:
            raise ValueError(f"video size: frames={size.frames}, but SD3 makes images: set frames: 1")
        config = _config(transformer)
        patch = config.patch_size
        shape = codec_of(vae).latent_shape(vae, 1, size.height, size.width, patch=(patch, patch))
        longest = max(shape[-2:]) // patch
        if config.pos_embed_max_size is not None and longest > config.pos_embed_max_size:
            raise ValueError(f"video size: {size.height}x{size.width} px is {longest} patches on a side, more than "
                             f"the transformer's pos_embed_max_size={config.pos_embed_max_size}: make the image "
                             f"smaller or raise pos_embed_max_size")
        return shape

    def schedule_kwargs(self, sampler, latent_shape):
        if sampler.scheduler.config.get("use_dynamic_shifting"):
            raise ValueError("SD3 samples with the scheduler's fixed `shift` (StableDiffusion3Pipeline's resolution "
                             "shift needs the patch grid): set use_dynamic_shifting: false")
        return {}

    def training_inputs(self, config, forward):
        _, _, h, w = forward.latent_shape
        clip_tokens = _config(forward.stage.card[forward.stage.encoders[0]]).max_position_embeddings
        return dict(hidden_states=(forward.rows, config["in_channels"], h, w), timestep=(forward.rows,),
                    encoder_hidden_states=(forward.rows, clip_tokens + forward.text_length,
                                           config["joint_attention_dim"]),
                    pooled_projections=(forward.rows, config["pooled_projection_dim"]))

    def pipeline_call(self, serving):
        return {key: serving[key] for key in ("num_inference_steps", "guidance_scale", "max_sequence_length",
                                              "height", "width")}


CLIP_DIM = TEXT_DIM // 2  # the two CLIPs' states side by side fill T5's width, as SD3's 768 + 1280 <= 4096
ARCHITECTURES = {
    # SD3's MMDiT, 0.1M parameters: 2×2 patches of the 16-channel image VAE (``vae_kl``); a 32 px image is 8×8
    # latents, 16 tokens. joint_attention_dim is T5's width, pooled_projection_dim the two CLIPs' projections.
    "sd3": Architecture(SD3Transformer2DModel, dict(
        sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=TEXT_DIM, caption_projection_dim=32,
        pooled_projection_dim=2 * CLIP_DIM, pos_embed_max_size=16,
    ), "generator", adapter=SD3(), layer_keys=("num_layers",)),
    # SD3's CLIP text encoders (``CLIPTextModelWithProjection``), ByT5 ids as every tiny text model; the pipeline
    # pads both to the first tokenizer's ``model_max_length`` (this position table).
    "clip_projection": Architecture(CLIPTextModelWithProjection, dict(
        vocab_size=BYT5_VOCAB, hidden_size=CLIP_DIM, intermediate_size=32, projection_dim=CLIP_DIM,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=1,
    ), "text_encoder", tokenizer_length_key="max_position_embeddings"),
}
