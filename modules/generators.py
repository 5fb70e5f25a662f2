"""Generator architectures as adapters, and the stage that binds one to a card.

The sampler, the SDE step, the C2 check and every method are one code path over all generators. What
differs between architectures lives in an adapter (FastVideo's ``ModelBase`` idea, diffusers' pipelines
as the reference of each): how the text stack encodes a prompt into a ``Conditioning``, how the
transformer is called as a velocity, how latents are shaped, encoded and decoded, and what the
pipeline passes to ``scheduler.set_timesteps``.

A ``GeneratorStage`` binds an adapter to the experts of a card (``transformer``, ``vae``, the text
encoders, by name), so methods say ``stage.condition(prompts)``, ``stage.velocity("transformer_ema")``
or ``stage.decode(latents)`` and never name a component or call a model themselves.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from diffusers.pipelines.wan.pipeline_wan import prompt_clean

from posttrain.modules import vae as vae_codec
from posttrain.modules.cards import ModelCard
from posttrain.modules.conditioning import Conditioning
from posttrain.modules.samplers import FlowMatchSampler, Schedule, Trajectory, VelocityFn


@dataclass(frozen=True)
class VideoSize:
    """Pixel size of what a method generates (rollouts, sample videos, ``predict``). An image is a
    one-frame video. Wan's VAE needs ``frames = 4k + 1``; height and width must be multiples of the VAE's
    spatial factor times the transformer's patch size (both read from the models' configs)."""

    frames: int = 9
    height: int = 32
    width: int = 32


class GeneratorAdapter:
    """How one architecture is driven. Subclasses follow their diffusers pipeline."""

    #: text-encoder experts the architecture reads, in the pipeline's order
    text_encoders: tuple[str, ...] = ("text_encoder",)

    def condition(self, card: ModelCard, prompts: list[str], encoders: tuple[str, ...]) -> Conditioning:
        raise NotImplementedError

    def velocity(self, transformer: torch.nn.Module, x: torch.Tensor, timestep: torch.Tensor,
                 cond: Conditioning) -> torch.Tensor:
        raise NotImplementedError

    def latent_shape(self, transformer: torch.nn.Module, vae: torch.nn.Module, size: VideoSize) -> tuple[int, ...]:
        raise NotImplementedError

    def schedule_kwargs(self, sampler: FlowMatchSampler, latent_shape: tuple[int, ...]) -> dict:
        """What the pipeline passes to ``scheduler.set_timesteps`` besides the step count."""
        return {}

    def pipeline_class(self) -> type:
        """The diffusers pipeline that serves this architecture (what export writes a folder for)."""
        raise NotImplementedError

    def pipeline(self, components: dict):
        """The pipeline object of exported ``components`` (transformer, vae, text_encoder[_2], tokenizer[_2],
        scheduler), ready for ``save_pretrained``."""
        return self.pipeline_class()(**components)


def _config(model: torch.nn.Module):
    model = model.module if type(model).__name__ == "DeepSpeedEngine" else model
    return model.config


class WanT2V(GeneratorAdapter):
    """Wan 2.1 text-to-video (``WanPipeline``): UMT5 hidden states, zero beyond each prompt's tokens."""

    def pipeline_class(self):
        from diffusers import WanPipeline

        return WanPipeline

    def condition(self, card, prompts, encoders):
        (encoder,) = encoders
        embeds = card.text_embeds(encoder, prompts, lambda missing: umt5_embeds(card, encoder, missing))
        return Conditioning(encoder_hidden_states=embeds)

    def velocity(self, transformer, x, timestep, cond):
        dtype = next(transformer.parameters()).dtype
        return transformer(hidden_states=x.to(dtype), timestep=timestep,
                           encoder_hidden_states=cond["encoder_hidden_states"].to(dtype), return_dict=False)[0]

    def latent_shape(self, transformer, vae, size):
        patch = _config(transformer).patch_size
        return vae_codec.latent_shape(vae, size.frames, size.height, size.width, patch=(patch[1], patch[2]))


@torch.no_grad()
def umt5_embeds(card: ModelCard, encoder: str, prompts: list[str]) -> torch.Tensor:
    """(B, L, D) last hidden states in the encoder's dtype, zero after each prompt's tokens
    (``WanPipeline._get_t5_prompt_embeds``: the prompt cleaned, padded to ``text_max_length``, special tokens
    added)."""
    tokenizer, model = card.tokenizers[encoder], card[encoder]
    tokens = tokenizer([prompt_clean(p) for p in prompts], padding="max_length", max_length=card.text_max_length,
                       truncation=True, add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    device = next(model.parameters()).device
    ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
    hidden = model(ids, mask).last_hidden_state
    return hidden * mask.unsqueeze(-1).to(hidden.dtype)


ADAPTERS: dict[str, GeneratorAdapter] = {"wan_t2v": WanT2V()}


@dataclass
class GeneratorStage:
    """One generator of a card: its adapter and the names of the experts it runs.

    Args:
        card: the card holding the experts.
        transformer: the generator expert (roles such as ``transformer_ema`` are run by name).
        vae: the VAE expert.
        text_encoders: the text-encoder experts; None = the adapter's (``text_encoder``, …).
    """

    card: ModelCard
    transformer: str = "transformer"
    vae: str = "vae"
    text_encoders: Optional[tuple[str, ...]] = None

    @property
    def adapter(self) -> GeneratorAdapter:
        arch = self.card.specs[self.transformer].arch
        if arch not in ADAPTERS:
            raise ValueError(f"expert {self.transformer!r} has arch {arch!r}, which is not a generator; "
                             f"generators: {sorted(ADAPTERS)}")
        return ADAPTERS[arch]

    @property
    def encoders(self) -> tuple[str, ...]:
        return tuple(self.text_encoders or self.adapter.text_encoders)

    def problems(self) -> list[str]:
        """Experts this stage needs that the card lacks (collected into a method's start-up message)."""
        names = (self.transformer, self.vae, *self.encoders)
        problems = [f"the card has no {name!r}" for name in names if not self.card.has(name)]
        arch = self.card.specs[self.transformer].arch if self.transformer in self.card.specs else None
        if arch is not None and arch not in ADAPTERS:
            problems.append(f"expert {self.transformer!r} has arch {arch!r}; a generator is one of {sorted(ADAPTERS)}")
        return problems

    # ------------------------------------------------------------------ conditioning
    def condition(self, prompts: list[str], device: Optional[torch.device] = None) -> Conditioning:
        """The conditioning of ``prompts`` (text rows cached by encoder version and prompt)."""
        return self.adapter.condition(self.card, prompts, self.encoders).to(device)

    def conditioning(self, prompts: list[str], guidance_scale: float,
                     device: Optional[torch.device] = None) -> tuple[Conditioning, Optional[Conditioning]]:
        """``prompts``' conditioning and, when CFG is on, the empty prompt's (cached like any prompt)."""
        cond = self.condition(prompts, device)
        return cond, (None if guidance_scale == 1.0 else self.condition([""] * len(prompts), device))

    # ------------------------------------------------------------------ the transformer
    @contextlib.contextmanager
    def velocity(self, name: Optional[str] = None) -> Iterator[VelocityFn]:
        """The velocity function of component ``name`` (default: the stage's transformer); a LoRA
        reference runs the policy with its adapter off inside the context."""
        with self.card.use(name or self.transformer) as module:
            yield lambda x, t, cond: self.adapter.velocity(module, x, t, cond)

    def latent_shape(self, size: VideoSize) -> tuple[int, ...]:
        """(C, F', h, w) latents of a ``size`` video, checked against the VAE and patch factors."""
        return self.adapter.latent_shape(self.card[self.transformer], self.card[self.vae], size)

    def schedule(self, sampler: FlowMatchSampler, latent_shape: tuple[int, ...],
                 device: Optional[torch.device] = None) -> Schedule:
        return sampler.schedule(device, **self.adapter.schedule_kwargs(sampler, latent_shape))

    @torch.no_grad()
    def sample(self, sampler: FlowMatchSampler, noise: torch.Tensor, cond: Conditioning,
               uncond: Optional[Conditioning] = None, name: Optional[str] = None, **kwargs) -> Trajectory:
        """Denoise ``noise`` with component ``name`` through the one sampler (``kwargs``: ``sde``,
        ``capture``, ``generator``, ``guidance_scale``)."""
        schedule = self.schedule(sampler, tuple(noise.shape[1:]), noise.device)
        with self.velocity(name) as fn:
            return sampler.sample(fn, noise, cond, uncond, schedule=schedule, **kwargs)

    # ------------------------------------------------------------------ pixels
    def encode(self, video: torch.Tensor) -> torch.Tensor:
        return vae_codec.encode(self.card[self.vae], video)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return vae_codec.decode(self.card[self.vae], latents)
