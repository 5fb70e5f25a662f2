"""Samples of a text-to-video generator for evaluation, and their synthetic GenEval scores.

The sampling path is the package's serving path on plain modules (no card): the Wan T2V adapter's text
stack and velocity call, the one ``FlowMatchSampler`` over the scheduler's σ grid, the VAE codec.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from posttrain.modules import vae as vae_codec
from posttrain.modules.conditioning import Conditioning
from posttrain.modules.generators import ADAPTERS, VideoSize, wan_text_states, wan_tokens
from posttrain.modules.geneval import SyntheticGenEval
from posttrain.modules.samplers import FlowMatchSampler


@torch.no_grad()
def wan_condition(tokenizer, text_encoder: torch.nn.Module, prompts: Sequence[str],
                  text_max_length: int) -> Conditioning:
    """The Wan T2V conditioning of ``prompts`` (``umt5_embeds`` without a card)."""
    embeds = wan_text_states(text_encoder, *wan_tokens(tokenizer, list(prompts), text_max_length))
    return Conditioning(encoder_hidden_states=embeds)


@torch.no_grad()
def generate(transformer: torch.nn.Module, text_encoder: torch.nn.Module, tokenizer, vae: torch.nn.Module,
             prompts: Sequence[str], seed: int = 0, frames: int = 5, height: int = 32, width: int = 32,
             sampler: Optional[FlowMatchSampler] = None, text_max_length: int = 64) -> torch.Tensor:
    """(B, 3, F, H, W) decoded ODE samples of ``prompts`` from noise seeded by ``seed``, as ``predict``
    makes them (the configs' sampler by default: 20 Euler steps, shift 3). The one place evaluation
    calls the sampler."""
    sampler = sampler or FlowMatchSampler(num_steps=20)
    adapter = ADAPTERS["wan_t2v"]
    shape = adapter.latent_shape(transformer, vae, VideoSize(frames, height, width))
    noise = torch.randn((len(prompts), *shape), generator=torch.Generator().manual_seed(seed))
    cond = wan_condition(tokenizer, text_encoder, prompts, text_max_length)
    uncond = None
    if sampler.guidance_scale != 1.0:
        uncond = wan_condition(tokenizer, text_encoder, [""] * len(prompts), text_max_length)
    schedule = sampler.schedule(noise.device, **adapter.schedule_kwargs(sampler, tuple(noise.shape[1:])))
    latents = sampler.sample(lambda x, t, c: adapter.velocity(transformer, x, t, c), noise, cond, uncond,
                             schedule=schedule).latents
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
