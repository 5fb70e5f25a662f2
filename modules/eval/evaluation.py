"""Samples of a generator for evaluation, and their synthetic GenEval scores.

The sampling path is the package's serving path (``GeneratorStage``: the adapter's text stack and velocity call,
the one ``FlowMatchSampler`` over the scheduler's σ grid, the VAE codec) on plain modules, which a card made here
holds under the adapter's names. ``arch`` names the generator's architecture (the world's Wan T2V by default).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from posttrain.modules.models import presets
from posttrain.modules.models.cards import Expert, ModelCard
from posttrain.modules.models.generators import GeneratorStage, VideoSize
from posttrain.modules.world.geneval import SyntheticGenEval
from posttrain.modules.flow.samplers import FlowMatchSampler

Modules = Union[torch.nn.Module, Sequence[torch.nn.Module]]


def stage_of(transformer: torch.nn.Module, text_encoder: Modules, tokenizer, vae: torch.nn.Module,
             arch: str = "wan_t2v", text_max_length: int = 64, transformer_2: Optional[torch.nn.Module] = None,
             boundary_ratio: Optional[float] = None) -> GeneratorStage:
    """The generator stage of plain modules: ``transformer`` of ``arch``, its text encoder(s) and tokenizer(s)
    (one each, or a sequence in the adapter's order, e.g. FLUX's CLIP then T5) and its VAE, on a card of their
    own (its prompt cache lives as long as the stage). With ``transformer_2``, a pair of noise experts handing over
    at ``boundary_ratio`` (Wan 2.2 A14B: ``transformer`` the high-noise expert)."""
    adapter = presets.architecture(arch).adapter
    if adapter is None:
        raise ValueError(f"arch {arch!r} is not a generator; generators: {presets.archs('generator')}")
    encoders = [text_encoder] if isinstance(text_encoder, torch.nn.Module) else list(text_encoder)
    tokenizers = list(tokenizer) if isinstance(tokenizer, (list, tuple)) else [tokenizer]
    if len(encoders) != len(adapter.text_encoders) or len(tokenizers) != len(encoders):
        raise ValueError(f"{type(adapter).__name__} reads {len(adapter.text_encoders)} text encoder(s) "
                         f"({', '.join(adapter.text_encoder_archs)}); got {len(encoders)} and {len(tokenizers)} "
                         f"tokenizer(s)")
    vae_arch = next(name for name in presets.archs("vae") if type(vae) is presets.model_class(name))
    generators = {"transformer": transformer, **({} if transformer_2 is None else {"transformer_2": transformer_2})}
    specs = {**{name: Expert(arch=arch) for name in generators}, "vae": Expert(arch=vae_arch),
             **{name: Expert(arch=kind) for name, kind in zip(adapter.text_encoders, adapter.text_encoder_archs)}}
    card = ModelCard(specs, text_max_length=text_max_length, boundary_ratio=boundary_ratio)
    card.models.update({**generators, "vae": vae, **dict(zip(adapter.text_encoders, encoders))})
    card.tokenizers.update(dict(zip(adapter.text_encoders, tokenizers)))
    return GeneratorStage.named(card)


@torch.no_grad()
def generate(transformer: torch.nn.Module, text_encoder: Modules, tokenizer, vae: torch.nn.Module,
             prompts: Sequence[str], seed: int = 0, frames: int = 5, height: int = 32, width: int = 32,
             sampler: Optional[FlowMatchSampler] = None, text_max_length: int = 64,
             arch: str = "wan_t2v", transformer_2: Optional[torch.nn.Module] = None,
             boundary_ratio: Optional[float] = None, images: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B, 3, F, H, W) decoded ODE samples of ``prompts`` from noise seeded by ``seed``, as ``predict``
    makes them (the configs' sampler by default: 20 Euler steps, shift 3), through ``transformer`` or the pair
    ``transformer`` / ``transformer_2`` at ``boundary_ratio``; with ``images`` (B, 3, H, W) in [-1, 1], image-to-video
    from those first frames (CFG's negative pass swaps only the text). The one place evaluation calls the sampler."""
    sampler = sampler or FlowMatchSampler(num_steps=20)
    stage = stage_of(transformer, text_encoder, tokenizer, vae, arch, text_max_length, transformer_2, boundary_ratio)
    size = VideoSize(frames, height, width)
    noise = torch.randn((len(prompts), *stage.latent_shape(size)), generator=torch.Generator().manual_seed(seed))
    cond, uncond = stage.conditioning(list(prompts), sampler.guidance_scale, images=images, size=size)
    return stage.decode(stage.sample(sampler, noise, cond, uncond).latents)


def evaluate_generator(transformer: torch.nn.Module, text_encoder: Modules, tokenizer,
                       vae: torch.nn.Module, prompts: Sequence[str], batch_size: int = 16, seed: int = 0,
                       images: Optional[torch.Tensor] = None, **generate_kwargs) -> dict[str, torch.Tensor]:
    """Synthetic GenEval of a generator's samples of ``prompts`` (batch ``i`` from seed ``seed + i``; ``images``: one
    first frame per prompt, for image-to-video; ``generate_kwargs``: ``generate``'s, e.g. a pair's ``transformer_2``
    and ``boundary_ratio``)."""
    metric = SyntheticGenEval()
    for i in range(0, len(prompts), batch_size):
        batch = list(prompts[i:i + batch_size])
        first = None if images is None else images[i:i + batch_size]
        metric.update(generate(transformer, text_encoder, tokenizer, vae, batch, seed=seed + i // batch_size,
                               images=first, **generate_kwargs), batch)
    return metric.compute()
