"""Generator architectures as adapters, and the stage that binds one to a card.

The sampler, the SDE step, the log-probability parity check and every method are one code path over all generators. What
differs between architectures lives in an adapter (FastVideo's ``ModelBase`` idea, diffusers' pipelines
as the reference of each): how the text stack encodes a prompt, what else the transformer reads (a
conditioning image), how the transformer is called as a velocity, how latents are shaped, and what the
pipeline passes to ``scheduler.set_timesteps``. All of it is one ``Conditioning`` per batch.

Every adapter keeps latents as ``(B, C, F', h, w)`` (an image is one frame), so decoding, rewards,
finetuning and the SDE are shared; an architecture that runs on another layout converts inside
``velocity`` (FLUX packs 2×2 patches into tokens there, exactly as ``FluxPipeline._pack_latents``).

| adapter | pipeline | conditioning (all (B, ...)) |
|---|---|---|
| ``WanT2V`` | ``WanPipeline`` | ``encoder_hidden_states`` (B, L, D) |
| ``WanI2V`` | ``WanImageToVideoPipeline`` | + ``image_latents`` (B, T + C, F', h, w): first-frame mask (T = the VAE's temporal factor) and the VAE latents of [image, zeros]; + ``encoder_hidden_states_image`` (B, N, D') with a Wan 2.1 image encoder |
| ``Flux`` | ``FluxPipeline`` | ``encoder_hidden_states`` (B, L, D) from T5, ``pooled_projections`` (B, D) from CLIP, ``guidance`` (B,) for guidance-distilled weights |

Each family file declares its ``ARCHITECTURES`` (``base.Architecture``: class, preset, asset, adapter or VAE codec,
…); this package imports every module in it and collects them, so a new family, with its VAE, is one new file and
no edit here: ``ARCHITECTURES`` is every family's, ``ADAPTERS`` the adapter of each generator architecture, and
``base.CODECS`` the codec of each VAE class (what ``modules.models.vae`` dispatches on).

A ``GeneratorStage`` binds an adapter to the experts of a card (``transformer``, ``vae``, the text
encoders, an image encoder, by name), so methods say ``stage.condition(prompts)``,
``stage.velocity("transformer_ema")`` or ``stage.decode(latents)`` and never name a component or call a
model themselves. Several stages can share one card under name prefixes (``t2i_transformer``,
``i2v_transformer``: ``GeneratorStage.named(card, "t2i")``), which is how a workflow holds its models.
"""
from __future__ import annotations

import contextlib
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from posttrain.modules.flow.conditioning import Conditioning
from posttrain.modules.models.generators.base import CODECS, Architecture, Card, GeneratorAdapter, VideoSize, codec_of
from posttrain.modules.models.generators.flux import Flux, clip_pooled_embeds, t5_embeds
from posttrain.modules.models.generators.wan import WanI2V, WanT2V, umt5_embeds, wan21_image_processor, wan_text_states, wan_tokens
from posttrain.modules.flow.samplers import FlowMatchSampler, Schedule, Trajectory, VelocityFn, guided

__all__ = ["ADAPTERS", "ARCHITECTURES", "Architecture", "GeneratorAdapter", "GeneratorStage", "VideoSize", "WanT2V",
           "WanI2V", "Flux", "wan_tokens", "wan_text_states", "umt5_embeds", "wan21_image_processor",
           "clip_pooled_embeds", "t5_embeds"]


def _families() -> dict[str, Architecture]:
    """The ``ARCHITECTURES`` of every module of this package (one family per file), by name."""
    found: dict[str, Architecture] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for name, arch in getattr(module, "ARCHITECTURES", {}).items():
            if name in found:
                raise ValueError(f"arch {name!r} is declared twice in modules/models/generators/ (again in {info.name}.py)")
            adapter = arch.adapter
            if adapter is not None and len(adapter.text_encoder_archs) != len(adapter.text_encoders):
                raise ValueError(f"{info.name}.py: {type(adapter).__name__}.text_encoder_archs must name the arch of "
                                 f"each of its text_encoders {adapter.text_encoders}")
            if arch.kind == "vae":
                if arch.codec is None:
                    raise ValueError(f"{info.name}.py: the VAE {name!r} needs a codec (`codec=` a base.VAECodec: how "
                                     f"its pixels become normalized latents)")
                known = CODECS.setdefault(arch.cls, arch.codec)
                if type(known) is not type(arch.codec):
                    raise ValueError(f"{info.name}.py: {arch.cls.__name__} ({name!r}) already has the codec "
                                     f"{type(known).__name__}")
            found[name] = arch
    return found


ARCHITECTURES: dict[str, Architecture] = _families()
ADAPTERS: dict[str, GeneratorAdapter] = {name: arch.adapter for name, arch in ARCHITECTURES.items()
                                         if arch.adapter is not None}


@dataclass
class GeneratorStage:
    """One generator of a card: its adapter and the names of the experts it runs.

    Args:
        card: the card holding the experts.
        transformer: the generator expert (roles such as ``transformer_ema`` are run by name).
        vae: the VAE expert.
        text_encoders: the text-encoder experts; None = the adapter's (``text_encoder``, …).
        image_encoder: a Wan 2.1 I2V transformer's CLIP vision expert; None = ``image_encoder`` when the
            card has one.
        embedded_guidance: the guidance value a guidance-distilled FLUX embeds (FluxPipeline's
            ``guidance_scale``); None = the adapter's default (``Flux.embedded_guidance``); ignored by weights
            without ``guidance_embeds``.
        num_train_timesteps: the sampler's scheduler's (``FlowMatchSampler.num_train_timesteps``): a pair of
            noise experts hands over at ``card.boundary_ratio`` times it.

    A pair of noise experts (Wan 2.2 A14B; the card's ``boundary_ratio``): the card holds ``<transformer>_2`` too,
    and running the stage's transformer (or a role of either expert, ``transformer_reference``) runs the pair,
    each row through the expert whose range holds its timestep (``noise_experts``), as ``WanPipeline`` does.
    """

    card: Card
    transformer: str = "transformer"
    vae: str = "vae"
    text_encoders: Optional[tuple[str, ...]] = None
    image_encoder: Optional[str] = None
    embedded_guidance: Optional[float] = None
    num_train_timesteps: int = 1000

    def __post_init__(self):
        if self.image_encoder is None and self.card.has(self._prefix + "image_encoder"):
            self.image_encoder = self._prefix + "image_encoder"

    @property
    def _prefix(self) -> str:
        return self.transformer[: -len("transformer")] if self.transformer.endswith("transformer") else ""

    @classmethod
    def named(cls, card: Card, prefix: str = "", **kwargs) -> "GeneratorStage":
        """The stage of experts ``<prefix>_transformer``, ``<prefix>_vae``, ``<prefix>_text_encoder[_2]``
        (no prefix: the plain names), the adapter's encoders under the same prefix."""
        p = f"{prefix}_" if prefix else ""
        stage = cls(card, transformer=f"{p}transformer", vae=f"{p}vae", **kwargs)
        if stage.text_encoders is None and stage.arch in ADAPTERS:
            stage.text_encoders = tuple(f"{p}{name}" for name in stage.adapter.text_encoders)
        return stage

    @property
    def arch(self) -> Optional[str]:
        spec = self.card.specs.get(self.transformer)
        return spec.arch if spec is not None else None

    @property
    def adapter(self) -> GeneratorAdapter:
        arch = self.arch
        if arch not in ADAPTERS:
            raise ValueError(f"expert {self.transformer!r} has arch {arch!r}, which is not a generator; "
                             f"generators: {sorted(ADAPTERS)}")
        return ADAPTERS[arch]

    @property
    def encoders(self) -> tuple[str, ...]:
        return tuple(self.text_encoders or self.adapter.text_encoders)

    # ------------------------------------------------------------------ a pair of noise experts
    @property
    def transformer_2(self) -> Optional[str]:
        """The low-noise expert of a pair (``<transformer>_2``, diffusers' ``transformer_2``); None for one
        generator."""
        name = f"{self.transformer}_2"
        return name if self.card.boundary_ratio is not None and self.card.has(name) else None

    @property
    def generators(self) -> tuple[str, ...]:
        """The stage's generator experts: the transformer, and ``transformer_2`` of a pair."""
        return (self.transformer,) if self.transformer_2 is None else (self.transformer, self.transformer_2)

    @property
    def boundary_timestep(self) -> Optional[float]:
        """``boundary_ratio · num_train_timesteps`` (``WanPipeline``): the high-noise expert of a pair runs where
        t >= it; None on a card without a pair."""
        ratio = self.card.boundary_ratio
        return None if ratio is None else ratio * self.num_train_timesteps

    def pair_of(self, name: str) -> Optional[tuple[str, str]]:
        """(high-noise, low-noise) components that running ``name`` runs, on a card with a ``boundary_ratio``: for an
        expert ``X`` with a partner ``X_2`` (the stage's transformer, a DMD2 ``teacher``) the pair itself; for a role
        of either expert of a pair (``transformer_reference``, ``transformer_2_old``) each expert's copy in that role
        where the card has one, else the expert (a frozen expert is its own reference). None where ``name`` runs
        alone (one generator, ``transformer_2`` named on its own, a critic)."""
        if self.card.boundary_ratio is None:
            return None
        of, role = self.card.roles.get(name, (name, None))
        if self.card.has(f"{of}_2") and of in self.card.specs:
            pair = (of, f"{of}_2")
        elif role is not None and of.endswith("_2") and of[:-2] in self.card.specs:
            pair = (of[:-2], of)
        else:
            return None
        return pair if role is None else tuple(f"{n}_{role}" if self.card.has(f"{n}_{role}") else n for n in pair)

    def sigma_range(self, experts: list[str]) -> tuple[float, float]:
        """[low, high] of σ = t / num_train_timesteps (after any flow shift) that ``experts`` of the pair denoise:
        [boundary_ratio, 1] for ``transformer`` alone, [0, boundary_ratio] for ``transformer_2`` alone, else [0, 1]."""
        if self.transformer_2 is None or set(self.generators) <= set(experts):
            return 0.0, 1.0
        b = self.card.boundary_ratio
        return (b, 1.0) if self.transformer in experts else (0.0, b)

    def expert_at(self, timestep: float) -> str:
        """The expert of the pair that runs at ``timestep`` (the stage's transformer for one generator)."""
        boundary = self.boundary_timestep
        return self.transformer if self.transformer_2 is None or timestep >= boundary else self.transformer_2

    @property
    def takes_image(self) -> bool:
        return self.adapter.takes_image

    def problems(self) -> list[str]:
        """Experts this stage needs that the card lacks (collected into a method's start-up message)."""
        problems = [f"the card has no {self.transformer!r}"] if not self.card.has(self.transformer) else []
        arch = self.arch
        if arch is not None and arch not in ADAPTERS:
            problems.append(f"expert {self.transformer!r} has arch {arch!r}; a generator is one of {sorted(ADAPTERS)}")
            return problems
        if not self.card.has(self.vae):
            problems.append(f"the card has no {self.vae!r}")
        if arch is None:
            return problems
        if self.transformer_2 is not None:  # the low-noise expert is driven like the high-noise one
            problems += self.peer_problems(self.transformer_2, "the low-noise expert")
        wanted = self.adapter.text_encoders
        if len(self.encoders) != len(wanted):
            problems.append(f"{type(self.adapter).__name__} ({self.transformer!r}) reads {len(wanted)} text encoders "
                            f"({', '.join(wanted)}), the stage names {list(self.encoders)}")
        for role, name, kind in zip(wanted, self.encoders, self.adapter.text_encoder_archs):
            if not self.card.has(name):
                problems.append(f"the card has no {name!r}: {type(self.adapter).__name__} ({self.transformer!r}) reads "
                                f"it as its {role}; add `{name}: {{arch: {kind}}}` to card.experts")
        archs = [self.card.specs[n].arch for n in self.encoders if n in self.card.specs]
        return problems + self.adapter.text_encoder_problems(self, archs)

    def peer_problems(self, name: str, role: str, trainable: Optional[bool] = None, hint: str = "") -> list[str]:
        """Problems of another generator this stage runs by name (a teacher, a critic): on the card, driven by
        the same adapter as the stage's transformer, and trainable or frozen as the method needs (None: either)."""
        spec = self.card.specs.get(name)
        if spec is None:
            return [f"the card has no {name!r} ({role}){hint}"]
        problems = []
        own = self.arch
        if spec.arch not in ADAPTERS or (own in ADAPTERS and ADAPTERS[spec.arch] is not ADAPTERS[own]):
            problems.append(f"{name!r} ({role}) has arch {spec.arch!r}; it must be a generator run like "
                            f"{self.transformer!r} ({own!r})")
        if trainable is True and not spec.trainable:
            problems.append(f"{name!r} ({role}) trains: set `trainable: true` and give it an optimizer")
        if trainable is False and spec.trainable:
            problems.append(f"{name!r} ({role}) must be frozen: set `trainable: false` and drop its optimizer")
        return problems

    # ------------------------------------------------------------------ conditioning
    def condition(self, prompts: list[str], device: Optional[torch.device] = None, *,
                  images: Optional[torch.Tensor] = None, size: Optional[VideoSize] = None,
                  latents: Optional[torch.Tensor] = None) -> Conditioning:
        """The conditioning of ``prompts`` (text rows cached by encoder version and prompt) and, for an
        image-to-video generator, of the first frames ``images`` (B, 3, H, W) in [-1, 1] of ``size`` videos, or,
        without images, of the clips' clean ``latents`` where the adapter reads its image off them
        (``image_from_latents``)."""
        return self.conditioning(prompts, 1.0, device, images=images, size=size, latents=latents)[0]

    def conditioning(self, prompts: list[str], guidance_scale: Optional[float], device: Optional[torch.device] = None,
                     *, images: Optional[torch.Tensor] = None, size: Optional[VideoSize] = None,
                     latents: Optional[torch.Tensor] = None) -> tuple[Conditioning, Optional[Conditioning]]:
        """``prompts``' conditioning and, when CFG is on (``guidance_scale`` not 1; None: a method that guides at
        scales of its own, DMD2's real score), the empty prompt's with the same image (the pipelines' negative pass
        swaps only the text); the image is encoded once for both."""
        adapter = self.adapter
        rest = adapter.extra(self, len(prompts))
        from_latents = None
        if adapter.takes_image and images is None and latents is not None:
            from_latents = adapter.image_from_latents(self, latents.to(device) if device is not None else latents)
        if adapter.takes_image and from_latents is None and (images is None or size is None):
            given = (" and reads none off precomputed latents (Wan 2.2 TI2V does: `arch: wan22_ti2v_i2v`)"
                     if latents is not None else "")
            raise ValueError(f"{type(adapter).__name__} ({self.transformer!r}) generates from a first frame{given}: "
                             f"give it images (an image-producing stage before it in a workflow, or an "
                             f"`image`/`video` in the batch: a VideoFolder without latents_cache, SyntheticVideos)")
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"{len(images)} conditioning images for {len(prompts)} prompts")
        if from_latents is not None:
            rest.update(from_latents)
        elif images is not None:
            rest.update(adapter.image(self, images.to(device) if device is not None else images, size))
        cond = Conditioning({**adapter.text(self, prompts), **rest}).to(device)
        if guidance_scale == 1.0:
            return cond, None
        return cond, Conditioning({**adapter.text(self, [""] * len(prompts)), **rest}).to(device)

    # ------------------------------------------------------------------ the transformer
    @contextlib.contextmanager
    def velocity(self, name: Optional[str] = None) -> Iterator[VelocityFn]:
        """The velocity function of component ``name`` (default: the stage's transformer); a LoRA
        reference runs the policy with its adapter off inside the context. Every training forward runs here: for
        an expert with ``offload_activations`` a call with grad saves its tensors for backward in host memory."""
        name = name or self.transformer
        pair = self.pair_of(name)
        if pair is None:
            with self.card.use(name) as module:
                yield self._velocity_of(name, module)
            return
        with self.card.use(pair[0]) as high, self.card.use(pair[1]) as low:
            yield noise_experts(self._velocity_of(pair[0], high), self._velocity_of(pair[1], low),
                                self.boundary_timestep)

    def _velocity_of(self, name: str, module: torch.nn.Module) -> VelocityFn:
        """The adapter's velocity of ``module`` (component ``name``), its activations in host memory when the
        expert says ``offload_activations``."""
        adapter = self.adapter
        spec = self.card.specs.get(name)
        offload = spec is not None and spec.offload_activations

        def velocity(x, t, cond, **model_kwargs):
            saved = contextlib.nullcontext()
            if offload and torch.is_grad_enabled():  # pinned host buffers: the copies overlap the compute on CUDA
                saved = torch.autograd.graph.save_on_cpu(pin_memory=x.is_cuda)
            with saved:
                return adapter.velocity(module, x, t, cond, **model_kwargs)

        velocity.guided = adapter.guided  # how the sampler combines the conditional and unconditional velocities
        return velocity

    def new_cache(self, name: Optional[str] = None):
        """An empty KV cache of component ``name`` (default: the stage's transformer), which must be block-causal."""
        name = name or self.transformer
        cache = self.adapter.new_cache(self.card[name])
        if cache is None:
            raise ValueError(f"sampler.chunk_frames samples chunk by chunk with a KV cache, but {name!r} "
                             f"({self.card[name].__class__.__name__}) is not block-causal: give it "
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
        ``capture``, ``rng``; the CFG scale is the sampler's). Without grad, except with ``exit_step=k``: the
        returned x̂0 of step k then carries the caller's grad (steps before it never do). With
        ``sampler.chunk_frames`` the model is block-causal and samples chunk by chunk through a fresh KV cache."""
        schedule = self.schedule(sampler, tuple(noise.shape[1:]), noise.device)
        if sampler.chunk_frames is not None:
            kwargs["kv_cache"] = self.new_cache(name)
        clean = self.adapter.clean_latents(cond, tuple(noise.shape[1:]))  # an image-to-video model's first frame
        with torch.no_grad() if exit_step is None else contextlib.nullcontext(), self.velocity(name) as fn:
            return sampler.sample(fn, noise, cond, uncond, schedule=schedule, exit_step=exit_step, clean=clean,
                                  **kwargs)

    # ------------------------------------------------------------------ pixels
    @torch.no_grad()
    def encode(self, video: torch.Tensor) -> torch.Tensor:
        vae = self.card[self.vae]
        return codec_of(vae).encode(vae, video)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.card[self.vae]
        return codec_of(vae).decode(vae, latents)


def noise_experts(high: VelocityFn, low: VelocityFn, boundary_timestep: float) -> VelocityFn:
    """One velocity function over a pair of noise experts: each row runs ``high`` where its timestep is
    ``>= boundary_timestep``, else ``low`` (``WanPipeline``'s rule for ``transformer`` / ``transformer_2``). A
    sampling step reads one timestep for all rows, so it runs one expert; a training batch of mixed noise levels
    runs each expert on its rows, and gradients reach each expert from its rows alone."""

    def velocity(x, t, cond, **model_kwargs):
        t = t.expand(x.shape[0]) if t.ndim else t.reshape(1).expand(x.shape[0])
        is_high = t >= boundary_timestep
        if bool(is_high.all()):
            return high(x, t, cond, **model_kwargs)
        if not bool(is_high.any()):
            return low(x, t, cond, **model_kwargs)
        rows_high, rows_low = torch.nonzero(is_high).flatten(), torch.nonzero(~is_high).flatten()
        v_high = high(x[rows_high], t[rows_high], cond.select(rows_high), **model_kwargs)
        v_low = low(x[rows_low], t[rows_low], cond.select(rows_low), **model_kwargs)
        v = torch.cat([v_high.float(), v_low.float()])
        return v[torch.argsort(torch.cat([rows_high, rows_low]))]

    velocity.boundary_timestep = boundary_timestep  # the sampler's guidance_scale_2 guides the low-noise steps
    velocity.guided = getattr(high, "guided", guided)  # one adapter: the pair's experts guide alike
    return velocity
