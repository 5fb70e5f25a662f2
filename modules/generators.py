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
                 cond: Conditioning, **model_kwargs) -> torch.Tensor:
        """``model_kwargs``: what a block-causal transformer takes besides (``kv_cache``, ``update_cache``)."""
        raise NotImplementedError

    def new_cache(self, transformer: torch.nn.Module):
        """An empty KV cache of a block-causal ``transformer`` (chunked sampling); None if it has none."""
        new_cache = getattr(_unwrap(transformer), "new_cache", None)
        return new_cache() if callable(new_cache) else None

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


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DeepSpeed engine (``lit.strategy`` puts engines on the card)."""
    return model.module if type(model).__name__ == "DeepSpeedEngine" else model


def _config(model: torch.nn.Module):
    return _unwrap(model).config


class WanT2V(GeneratorAdapter):
    """Wan 2.1 text-to-video (``WanPipeline``): UMT5 hidden states, zero beyond each prompt's tokens.

    Also drives the block-causal student (``arch: wan_t2v_causal``, ``modules.causal_wan``): the same call
    plus its ``kv_cache``/``update_cache`` keywords. With a cache the input is exactly one chunk, so the
    chunk size of the call is the input's frame count.
    """

    def pipeline_class(self):
        from diffusers import WanPipeline

        return WanPipeline

    def condition(self, card, prompts, encoders):
        (encoder,) = encoders
        embeds = card.text_embeds(encoder, prompts, lambda missing: umt5_embeds(card, encoder, missing))
        return Conditioning(encoder_hidden_states=embeds)

    def velocity(self, transformer, x, timestep, cond, **model_kwargs):
        dtype = next(transformer.parameters()).dtype
        if model_kwargs.get("kv_cache") is not None:
            model_kwargs = {**model_kwargs, "num_frames_per_chunk": x.shape[2]}
        return transformer(hidden_states=x.to(dtype), timestep=timestep,
                           encoder_hidden_states=cond["encoder_hidden_states"].to(dtype), return_dict=False,
                           **model_kwargs)[0]

    def latent_shape(self, transformer, vae, size):
        patch = _config(transformer).patch_size
        return vae_codec.latent_shape(vae, size.frames, size.height, size.width, patch=(patch[1], patch[2]))


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
def umt5_embeds(card: ModelCard, encoder: str, prompts: list[str]) -> torch.Tensor:
    """``wan_text_states`` of ``wan_tokens`` of a card's frozen encoder (the pipeline's prompt embeddings)."""
    return wan_text_states(card[encoder], *wan_tokens(card.tokenizers[encoder], prompts, card.text_max_length))


_WAN_T2V = WanT2V()
# one adapter per architecture family: the block-causal Wan is driven like Wan T2V
ADAPTERS: dict[str, GeneratorAdapter] = {"wan_t2v": _WAN_T2V, "wan_t2v_causal": _WAN_T2V}


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

    def peer_problems(self, name: str, role: str, trainable: bool, hint: str = "") -> list[str]:
        """Problems of another generator this stage runs by name (a teacher, a critic): on the card, driven by
        the same adapter as the stage's transformer, and trainable or frozen as the method needs."""
        spec = self.card.specs.get(name)
        if spec is None:
            return [f"the card has no {name!r} ({role}){hint}"]
        problems = []
        own = self.card.specs[self.transformer].arch if self.transformer in self.card.specs else None
        if spec.arch not in ADAPTERS or (own in ADAPTERS and ADAPTERS[spec.arch] is not ADAPTERS[own]):
            problems.append(f"{name!r} ({role}) has arch {spec.arch!r}; it must be a generator run like "
                            f"{self.transformer!r} ({own!r})")
        if trainable and not spec.trainable:
            problems.append(f"{name!r} ({role}) trains: set `trainable: true` and give it an optimizer")
        if not trainable and spec.trainable:
            problems.append(f"{name!r} ({role}) must be frozen: set `trainable: false` and drop its optimizer")
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
            yield lambda x, t, cond, **model_kwargs: self.adapter.velocity(module, x, t, cond, **model_kwargs)

    def new_cache(self, name: Optional[str] = None):
        """An empty KV cache of component ``name`` (default: the stage's transformer), which must be block-causal."""
        name = name or self.transformer
        cache = self.adapter.new_cache(self.card[name])
        if cache is None:
            raise ValueError(f"sampler.chunk_frames samples chunk by chunk with a KV cache, but {name!r} "
                             f"({type(_unwrap(self.card[name])).__name__}) is not block-causal: give it "
                             f"`arch: wan_t2v_causal`, or set sampler.chunk_frames: null")
        return cache

    def latent_shape(self, size: VideoSize) -> tuple[int, ...]:
        """(C, F', h, w) latents of a ``size`` video, checked against the VAE and patch factors."""
        return self.adapter.latent_shape(self.card[self.transformer], self.card[self.vae], size)

    def schedule(self, sampler: FlowMatchSampler, latent_shape: tuple[int, ...],
                 device: Optional[torch.device] = None) -> Schedule:
        return sampler.schedule(device, **self.adapter.schedule_kwargs(sampler, latent_shape))

    def sample(self, sampler: FlowMatchSampler, noise: torch.Tensor, cond: Conditioning,
               uncond: Optional[Conditioning] = None, name: Optional[str] = None,
               exit_step: Optional[int] = None, **kwargs) -> Trajectory:
        """Denoise ``noise`` with component ``name`` through the one sampler (``kwargs``: ``sde``,
        ``capture``, ``generator``, ``guidance_scale``). Without grad, except with ``exit_step=k``: the
        returned x̂0 of step k then carries the caller's grad (steps before it never do). With
        ``sampler.chunk_frames`` the model is block-causal and samples chunk by chunk through a fresh KV cache."""
        schedule = self.schedule(sampler, tuple(noise.shape[1:]), noise.device)
        if sampler.chunk_frames is not None:
            kwargs["kv_cache"] = self.new_cache(name)
        with torch.no_grad() if exit_step is None else contextlib.nullcontext(), self.velocity(name) as fn:
            return sampler.sample(fn, noise, cond, uncond, schedule=schedule, exit_step=exit_step, **kwargs)

    # ------------------------------------------------------------------ pixels
    def encode(self, video: torch.Tensor) -> torch.Tensor:
        return vae_codec.encode(self.card[self.vae], video)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return vae_codec.decode(self.card[self.vae], latents)
