"""Qwen-Image text-to-image (``QwenImagePipeline``): an MMDiT (``QwenImageTransformer2DModel``) over the latents of
Qwen-Image's VAE (``AutoencoderKLQwenImage``, a Wan 2.1-style causal 3D VAE of 16 channels: an image is one frame),
reading the last hidden states of a Qwen2.5-VL language model (``Qwen2_5_VLForConditionalGeneration``, text only).

The prompt is encoded as ``QwenImagePipeline._get_qwen_prompt_embeds`` does: wrapped in the pipeline's chat template,
tokenized, run through the model with its attention mask; the last hidden states of each prompt's tokens, less the
template's first ``DROP_TOKENS`` (its system turn), padded with zeros. A cached row is padded to the card's
``text_max_length`` (the pipeline's ``max_sequence_length``); the padding mask is recomputed from the tokenizer alone
(``prompt_mask``), so rows from the cache and fresh ones read the same. The transformer then gets exactly the
pipeline's call: the batch's text cut to its longest prompt, ``encoder_hidden_states_mask`` where a prompt is
shorter (None when none is), 2×2 patches of the latents packed into tokens (``_pack_latents``), ``img_shapes``, the
timestep as σ (t / 1000). The σ grid is the pipeline's: ``linspace(1, 1/N, N)`` shifted by ``mu`` of the image
token count (``calculate_shift``).

Classifier-free guidance is the pipeline's ``true_cfg_scale`` with the empty negative prompt (``guided``): plain CFG,
v_u + g·(v_c − v_u), then each packed token's guided velocity rescaled to the norm of its conditional one.
"""
from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
from transformers import Qwen2_5_VLForConditionalGeneration

from posttrain.modules.models.generators.base import (BYT5_VOCAB, TEXT_DIM, Architecture, Card, GeneratorAdapter,
                                                      _dtype, codec_of)
from posttrain.modules.flow.samplers import guided
from posttrain.modules.models.generators.wan import WanVAE

# QwenImagePipeline.__init__'s prompt template (``prompt_template_encode``), the template tokens it drops from the
# encoder's output (``prompt_template_encode_start_idx``: the system turn and ``<|im_start|>user\n``, 34 tokens of
# Qwen2.5's tokenizer) and the longest prompt it encodes (``tokenizer_max_length``; ``max_sequence_length`` <= it)
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
DROP_TOKENS = 34
MAX_PROMPT_TOKENS = 1024
# A Qwen2Tokenizer of 367 tokens (bytes, the template's words, Qwen's special tokens) that splits the template's
# system turn into the same 34 tokens as Qwen2.5's: what the tiny text encoder reads (scripts/make_qwen_tokenizer.py)
TOKENIZER_ASSET = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                               "assets", "qwen_image_tokenizer")


def _template_tokens(tokenizer, prompts: list[str]):
    return tokenizer([PROMPT_TEMPLATE.format(p) for p in prompts], max_length=MAX_PROMPT_TOKENS + DROP_TOKENS,
                     padding=True, truncation=True, return_tensors="pt")


def qwen_prompt_embeds(tokenizer, model: torch.nn.Module, prompts: list[str], max_length: int) -> torch.Tensor:
    """(B, max_length, D) float32 prompt embeddings as ``QwenImagePipeline.encode_prompt`` computes them (its
    ``_get_qwen_prompt_embeds``, then cut to ``max_sequence_length``): the last hidden states of each prompt's
    templated tokens without the first ``DROP_TOKENS``, zero beyond them; with gradient."""
    tokens = _template_tokens(tokenizer, prompts)
    device = next(model.parameters()).device
    mask = tokens.attention_mask.to(device)
    hidden = model(input_ids=tokens.input_ids.to(device), attention_mask=mask, output_hidden_states=True
                   ).hidden_states[-1]
    rows = [states[keep.bool()][DROP_TOKENS:][:max_length] for states, keep in zip(hidden, mask)]
    return torch.stack([F.pad(row, (0, 0, 0, max_length - len(row))) for row in rows]).float()


def prompt_mask(tokenizer, prompts: list[str], max_length: int) -> torch.Tensor:
    """(B, max_length) 1 on each prompt's embedded tokens, 0 on the padding (``encode_prompt``'s
    ``prompt_embeds_mask``): the templated token count less ``DROP_TOKENS``, from the tokenizer alone."""
    lengths = _template_tokens(tokenizer, prompts).attention_mask.sum(1) - DROP_TOKENS
    return (torch.arange(max_length)[None] < lengths[:, None]).long()


@torch.no_grad()
def _prompt_rows(card: Card, encoder: str, prompts: list[str]) -> torch.Tensor:
    return qwen_prompt_embeds(card.tokenizers[encoder], card[encoder], prompts, card.text_max_length)


class QwenImage(GeneratorAdapter):
    """Qwen-Image (``QwenImagePipeline``): ``encoder_hidden_states`` (B, L, D) and ``encoder_hidden_states_mask``
    (B, L) from Qwen2.5-VL's last hidden states, the latents packed in 2×2 patches, σ as the timestep, the σ grid
    shifted by the image token count."""

    text_encoder_archs = ("qwen2_5_vl",)
    reads = "a Qwen2.5-VL language model (its last hidden states)"

    def pipeline_class(self):
        # imported on use: the pipeline module imports transformers' image processors
        from diffusers import QwenImagePipeline

        return QwenImagePipeline

    def text_encoder_problems(self, stage, archs):
        length = stage.card.text_max_length
        problems = super().text_encoder_problems(stage, archs)
        if length > MAX_PROMPT_TOKENS:
            problems.append(f"card.text_max_length={length}, but QwenImagePipeline embeds at most {MAX_PROMPT_TOKENS} "
                            f"prompt tokens (its max_sequence_length): set text_max_length <= {MAX_PROMPT_TOKENS}")
        return problems

    def text(self, stage, prompts):
        (encoder,) = stage.encoders
        card = stage.card
        states = card.text_embeds(encoder, prompts, lambda missing: _prompt_rows(card, encoder, missing))
        mask = prompt_mask(card.tokenizers[encoder], prompts, states.shape[1])
        return {"encoder_hidden_states": states, "encoder_hidden_states_mask": mask}

    def velocity(self, transformer, x, timestep, cond):
        pipeline = self.pipeline_class()
        dtype = _dtype(transformer)
        B, C, _, h, w = x.shape
        # encode_prompt's batch: the text up to the longest prompt of the batch, no mask where none is shorter
        mask = cond["encoder_hidden_states_mask"]
        length = int(mask.sum(1).max())
        states, mask = cond["encoder_hidden_states"][:, :length], mask[:, :length]
        timestep = timestep.expand(B) if timestep.ndim == 0 else timestep
        v = transformer(hidden_states=pipeline._pack_latents(x[:, :, 0], B, C, h, w).to(dtype),
                        timestep=(timestep / 1000).to(dtype), encoder_hidden_states=states.to(dtype),
                        encoder_hidden_states_mask=None if bool(mask.all()) else mask,
                        img_shapes=[[(1, h // 2, w // 2)]] * B, return_dict=False)[0]
        return pipeline._unpack_latents(v, h, w, 1)  # (B, C, 1, h, w): h, w are latent sizes, so factor 1

    def guided(self, v_cond, v_uncond, scale, rescale=0.0):
        # QwenImagePipeline's true CFG: the guided velocity of each packed token rescaled to the conditional one's norm
        v = guided(v_cond, v_uncond, scale, rescale)
        if v is v_cond:  # unguided
            return v
        pipeline = self.pipeline_class()
        B, C, _, h, w = v.shape
        comb, cond = (pipeline._pack_latents(t[:, :, 0], B, C, h, w) for t in (v, v_cond))
        comb = comb * (cond.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))
        return pipeline._unpack_latents(comb, h, w, 1)

    def latent_shape(self, transformer, vae, size):
        if size.frames != 1:
            raise ValueError(f"video size: frames={size.frames}, but Qwen-Image makes images: set frames: 1")
        # the latents are packed in 2×2 patches: H and W multiples of 2 × the VAE's factor (QwenImagePipeline)
        return codec_of(vae).latent_shape(vae, 1, size.height, size.width, patch=(2, 2))

    def schedule_kwargs(self, sampler, latent_shape):
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        n = sampler.num_steps
        config = sampler.scheduler.config
        mu = calculate_shift((latent_shape[-2] // 2) * (latent_shape[-1] // 2), config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        return {"sigmas": np.linspace(1.0, 1 / n, n), "mu": mu}

    def training_inputs(self, config, forward):
        # the packed 2×2 latent tokens and the prompt's states with their mask (every row the full text length:
        # an upper bound on encode_prompt's longest prompt); ``img_shapes`` is the list the pipeline passes
        _, _, h, w = forward.latent_shape
        tokens, length, rows = (h // 2) * (w // 2), forward.text_length, forward.rows
        return dict(hidden_states=(rows, tokens, config["in_channels"]), timestep=(rows,),
                    encoder_hidden_states=(rows, length, config["joint_attention_dim"]),
                    encoder_hidden_states_mask=(rows, length), img_shapes=[[(1, h // 2, w // 2)]] * rows)

    def attention_tokens(self, config, shapes):
        # the packed image tokens and the text, attended jointly
        return shapes["hidden_states"][1] + shapes["encoder_hidden_states"][1]

    def pipeline_call(self, serving):
        # classifier-free guidance is `true_cfg_scale` with a negative prompt (the empty prompt, as here); without
        # CFG true_cfg_scale 1 (the pipeline's default, 4.0, only warns without a negative prompt)
        cfg = serving["guidance_scale"]
        return {"num_inference_steps": serving["num_inference_steps"], "true_cfg_scale": cfg,
                "max_sequence_length": serving["max_sequence_length"], "height": serving["height"],
                "width": serving["width"]} | ({"negative_prompt": ""} if cfg != 1.0 else {})


class QwenImageVAE(WanVAE):
    """``AutoencoderKLQwenImage`` as ``QwenImagePipeline`` uses it: Wan's normalization (the config's
    ``latents_mean`` / ``latents_std`` per channel) and layout, one frame per image. Its config has no
    ``scale_factor_*``: the pipeline reads 2^len(temperal_downsample) as the spatial factor."""

    def scale_factors(self, vae):
        config = vae.config
        spatial = 2 ** len(config.temperal_downsample)  # QwenImagePipeline.vae_scale_factor
        if spatial != 2 ** (len(config.dim_mult) - 1):
            raise ValueError(f"the Qwen-Image VAE has dim_mult {list(config.dim_mult)} ({len(config.dim_mult) - 1} "
                             f"downsampling levels) but temperal_downsample {list(config.temperal_downsample)}: "
                             f"QwenImagePipeline reads one entry of temperal_downsample per level; give it "
                             f"{len(config.dim_mult) - 1} entries")
        return 2 ** sum(bool(t) for t in config.temperal_downsample), spatial

    def preset(self, config, given):
        """The preset as it is: unlike ``AutoencoderKLWan``, the class takes no ``scale_factor_*`` to complete."""
        return config


ARCHITECTURES = {
    # QwenImageTransformer2DModel: 2×2 packed latents of the 16-channel VAE (in_channels 64), the text encoder's
    # width as joint_attention_dim, RoPE axes summing to the head dim; FLUX's tiny width (2 heads of 32), 0.34M
    # parameters. A 32 px image is 8×8 latents, 16 tokens. Without overrides it loads the shipped asset, pretrained
    # on the world jointly with the ``qwen2_5_vl`` asset (scripts/train_qwen_image.py).
    "qwen_image": Architecture(QwenImageTransformer2DModel, dict(
        patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=32, num_attention_heads=2,
        joint_attention_dim=TEXT_DIM, axes_dims_rope=(8, 12, 12),
    ), "generator", adapter=QwenImage(), asset=True, layer_keys=("num_layers",)),
    # AutoencoderKLQwenImage: 4x spatial (three levels, two downsampling), 4x temporal (irrelevant to one frame),
    # 16 latent channels, width 16: the world's Wan VAE (``wan_vae``), whose weights this class loads key for key.
    # Without overrides it loads them (modules/assets/wan_vae, with their latents_mean / latents_std); with
    # overrides, random weights and Qwen-Image's published latents_mean / latents_std (the class defaults).
    "qwen_image_vae": Architecture(AutoencoderKLQwenImage, dict(
        base_dim=16, z_dim=16, dim_mult=[1, 1, 1], num_res_blocks=0, temperal_downsample=[True, True],
    ), "vae", codec=QwenImageVAE(), asset="wan_vae"),
    # Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``), read for its text only; the class carries a vision tower,
    # kept tiny. The vocabulary holds ByT5's ids too (384 >= the 367 of TOKENIZER_ASSET), so an expert without a
    # tokenizer folder reads ByT5 ids; mrope_section sums to half the head dim (8 of 16). Without overrides it loads
    # the shipped asset, trained with the ``qwen_image`` asset on TOKENIZER_ASSET's ids (give an expert that tokenizer).
    "qwen2_5_vl": Architecture(Qwen2_5_VLForConditionalGeneration, dict(
        text_config=dict(vocab_size=BYT5_VOCAB, hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
                         bos_token_id=None, eos_token_id=366, pad_token_id=364),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TEXT_DIM,
                           patch_size=2, window_size=8, fullatt_block_indexes=[0]),
    ), "text_encoder", asset=True),
}
