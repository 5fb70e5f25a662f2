"""Samples of a text-to-video generator for evaluation, and their synthetic GenEval scores."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from posttrain.modules import vae as vae_codec
from posttrain.modules.geneval import SyntheticGenEval
from posttrain.modules.samplers import FlowMatchSampler, wan_velocity
from posttrain.modules.text import encode_prompts


@torch.no_grad()
def generate(transformer: torch.nn.Module, text_encoder: torch.nn.Module, tokenizer, vae: torch.nn.Module,
             prompts: Sequence[str], seed: int = 0, frames: int = 5, height: int = 32, width: int = 32,
             sampler: Optional[FlowMatchSampler] = None, text_max_length: int = 64) -> torch.Tensor:
    """(B, 3, F, H, W) decoded ODE samples of ``prompts`` from noise seeded by ``seed``, as ``predict``
    makes them (the configs' sampler by default). The one place evaluation calls the sampler."""
    sampler = sampler or FlowMatchSampler(num_steps=20, shift=3.0)
    shape = vae_codec.latent_shape(vae, frames, height, width)
    noise = torch.randn((len(prompts), *shape), generator=torch.Generator().manual_seed(seed))
    cond = encode_prompts(tokenizer, text_encoder, list(prompts), text_max_length)
    uncond = None
    if sampler.guidance_scale != 1.0:
        uncond = encode_prompts(tokenizer, text_encoder, [""] * len(prompts), text_max_length)
    latents = sampler.sample(wan_velocity(transformer), noise, cond, uncond).latents
    return vae_codec.decode(vae, latents)


def evaluate_generator(transformer: torch.nn.Module, text_encoder: torch.nn.Module, tokenizer,
                       vae: torch.nn.Module, prompts: Sequence[str], batch_size: int = 16, seed: int = 0,
                       **generate_kwargs) -> dict[str, torch.Tensor]:
    """Synthetic GenEval of a generator's samples of ``prompts`` (batch ``i`` from seed ``seed + i``)."""
    metric = SyntheticGenEval()
    for i in range(0, len(prompts), batch_size):
        batch = list(prompts[i:i + batch_size])
        metric.update(generate(transformer, text_encoder, tokenizer, vae, batch, seed=seed + i // batch_size,
                               **generate_kwargs), batch)
    return metric.compute()
