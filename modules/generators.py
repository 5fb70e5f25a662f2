"""Generator architectures as adapters, and the stage that binds one to a card.

The sampler, the SDE step, the C2 check and every method are one code path over all generators. What
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

A ``GeneratorStage`` binds an adapter to the experts of a card (``transformer``, ``vae``, the text
encoders, an image encoder, by name), so methods say ``stage.condition(prompts)``,
``stage.velocity("transformer_ema")`` or ``stage.decode(latents)`` and never name a component or call a
model themselves. Several stages can share one card under name prefixes (``t2i_transformer``,
``i2v_transformer``: ``GeneratorStage.named(card, "t2i")``), which is how a workflow holds its models.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
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


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DeepSpeed engine (``lit.strategy`` puts engines on the card)."""
    return model.module if type(model).__name__ == "DeepSpeedEngine" else model


def _config(model: torch.nn.Module):
    return _unwrap(model).config


def _dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


class GeneratorAdapter:
    """How one architecture is driven. Subclasses follow their diffusers pipeline."""

    #: text-encoder experts the architecture reads, in the pipeline's order (``text_encoder``, ``text_encoder_2``)
    text_encoders: tuple[str, ...] = ("text_encoder",)
    #: whether the conditioning holds an image (the first frame of the video to generate)
    takes_image: bool = False

    def text(self, stage: "GeneratorStage", prompts: list[str]) -> dict[str, torch.Tensor]:
        """The text part of the conditioning of ``prompts`` (rows cached by encoder version and prompt)."""
        raise NotImplementedError

    def image(self, stage: "GeneratorStage", images: torch.Tensor, size: VideoSize) -> dict[str, torch.Tensor]:
        """The image part of the conditioning: ``images`` (B, 3, H, W) in [-1, 1] for a ``size`` output."""
        raise ValueError(f"{type(self).__name__} generates from text alone; it takes no conditioning image")

    def extra(self, stage: "GeneratorStage", batch_size: int) -> dict[str, torch.Tensor]:
        """Further per-row inputs that are neither text nor image (FLUX's embedded guidance)."""
        return {}

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
        scheduler, image_encoder, image_processor), ready for ``save_pretrained``."""
        return self.pipeline_class()(**components)

    def pipeline_call(self, serving: dict) -> dict:
        """The keyword arguments that make the pipeline sample as ``predict`` does (written to ``serving.json``),
        from a run's ``serving_settings``."""
        return {"num_inference_steps": serving["num_inference_steps"], "guidance_scale": serving["guidance_scale"],
                "max_sequence_length": serving["max_sequence_length"], "num_frames": serving["num_frames"],
                "height": serving["height"], "width": serving["width"]}


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


class WanT2V(GeneratorAdapter):
    """Wan 2.1 text-to-video (``WanPipeline``): UMT5 hidden states, zero beyond each prompt's tokens.

    Also drives the block-causal student (``arch: wan_t2v_causal``, ``modules.causal_wan``): the same call
    plus its ``kv_cache``/``update_cache`` keywords. With a cache the input is exactly one chunk, so the
    chunk size of the call is the input's frame count.
    """

    def pipeline_class(self):
        from diffusers import WanPipeline

        return WanPipeline

    def text(self, stage, prompts):
        (encoder,) = stage.encoders
        card = stage.card
        return {"encoder_hidden_states": card.text_embeds(encoder, prompts,
                                                          lambda missing: umt5_embeds(card, encoder, missing))}

    def velocity(self, transformer, x, timestep, cond, **model_kwargs):
        dtype = _dtype(transformer)
        if model_kwargs.get("kv_cache") is not None:
            model_kwargs = {**model_kwargs, "num_frames_per_chunk": x.shape[2]}
        return transformer(hidden_states=x.to(dtype), timestep=timestep,
                           encoder_hidden_states=cond["encoder_hidden_states"].to(dtype), return_dict=False,
                           **model_kwargs)[0]

    def latent_shape(self, transformer, vae, size):
        patch = _config(transformer).patch_size
        return vae_codec.latent_shape(vae, size.frames, size.height, size.width, patch=(patch[1], patch[2]))


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
        temporal, _ = vae_codec.scale_factors(vae)
        # 1. the conditioning video: the image, then F-1 zero (mid-grey) frames, through the VAE
        B, _, H, W = images.shape
        video = torch.cat([images[:, :, None], images.new_zeros(B, 3, size.frames - 1, H, W)], dim=2)
        latents = vae_codec.encode(vae, video)  # (B, C, F', h, w), normalized as the pipeline does
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
def clip_image_states(stage: "GeneratorStage", images: torch.Tensor) -> torch.Tensor:
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
def clip_pooled(card: ModelCard, encoder: str, prompts: list[str]) -> torch.Tensor:
    return clip_pooled_embeds(card.tokenizers[encoder], card[encoder], prompts)


@torch.no_grad()
def t5_states(card: ModelCard, encoder: str, prompts: list[str]) -> torch.Tensor:
    return t5_embeds(card.tokenizers[encoder], card[encoder], prompts, card.text_max_length)


class Flux(GeneratorAdapter):
    """FLUX text-to-image (``FluxPipeline``): CLIP's pooled vector and T5's token states as text, 2×2
    patches of the latents packed into tokens with (0, row, column) position ids, the timestep as σ
    (t / 1000), and for guidance-distilled weights (``guidance_embeds``) the embedded guidance value.
    The σ grid is the pipeline's: ``linspace(1, 1/N, N)`` shifted by ``mu`` of the token count."""

    text_encoders = ("text_encoder", "text_encoder_2")

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
        return {"guidance": torch.full((batch_size,), float(stage.embedded_guidance))}

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
        cfg = serving["guidance_scale"]
        call = {"num_inference_steps": serving["num_inference_steps"], "max_sequence_length": serving["max_sequence_length"],
                "height": serving["height"], "width": serving["width"],
                "guidance_scale": serving.get("embedded_guidance", 3.5)}
        return call | ({"true_cfg_scale": cfg, "negative_prompt": ""} if cfg != 1.0 else {})

    def latent_shape(self, transformer, vae, size):
        if size.frames != 1:
            raise ValueError(f"video size: frames={size.frames}, but FLUX makes images: set frames: 1")
        # the latents are packed in 2×2 patches: H and W multiples of 2 × the VAE's factor (FluxPipeline.check_inputs)
        return vae_codec.latent_shape(vae, 1, size.height, size.width, patch=(2, 2))

    def schedule_kwargs(self, sampler, latent_shape):
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        n = sampler.num_steps
        config = sampler.scheduler.config
        sigmas = None if config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / n, n)
        mu = calculate_shift((latent_shape[-2] // 2) * (latent_shape[-1] // 2), config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        return {"sigmas": sigmas, "mu": mu}


_WAN_T2V = WanT2V()
# one adapter per architecture family: the block-causal Wan is driven like Wan T2V
ADAPTERS: dict[str, GeneratorAdapter] = {"wan_t2v": _WAN_T2V, "wan_t2v_causal": _WAN_T2V, "wan_i2v": WanI2V(),
                                         "flux": Flux()}


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
            ``guidance_scale``); ignored by weights without ``guidance_embeds``.
    """

    card: ModelCard
    transformer: str = "transformer"
    vae: str = "vae"
    text_encoders: Optional[tuple[str, ...]] = None
    image_encoder: Optional[str] = None
    embedded_guidance: float = 3.5

    def __post_init__(self):
        if self.image_encoder is None and self.card.has(self._prefix + "image_encoder"):
            self.image_encoder = self._prefix + "image_encoder"

    @property
    def _prefix(self) -> str:
        return self.transformer[: -len("transformer")] if self.transformer.endswith("transformer") else ""

    @classmethod
    def named(cls, card: ModelCard, prefix: str = "", **kwargs) -> "GeneratorStage":
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
        wanted = self.adapter.text_encoders
        if len(self.encoders) != len(wanted):
            problems.append(f"{type(self.adapter).__name__} ({self.transformer!r}) reads {len(wanted)} text encoders "
                            f"({', '.join(wanted)}), the stage names {list(self.encoders)}")
        for role, name in zip(wanted, self.encoders):
            if not self.card.has(name):
                kind = {"flux": {"text_encoder": "clip", "text_encoder_2": "t5"}}.get(arch, {}).get(role, "umt5")
                problems.append(f"the card has no {name!r}: {type(self.adapter).__name__} ({self.transformer!r}) reads "
                                f"it as its {role}; add `{name}: {{arch: {kind}}}` to card.experts")
        if arch == "flux":
            kinds = [self.card.specs[n].arch for n in self.encoders if n in self.card.specs]
            if len(kinds) == 2 and kinds != ["clip", "t5"]:
                problems.append(f"Flux ({self.transformer!r}) reads a CLIP text encoder (pooled) then a T5 encoder; "
                                f"{list(self.encoders)} are {kinds}: give `arch: clip` and `arch: t5`")
        return problems

    def peer_problems(self, name: str, role: str, trainable: bool, hint: str = "") -> list[str]:
        """Problems of another generator this stage runs by name (a teacher, a critic): on the card, driven by
        the same adapter as the stage's transformer, and trainable or frozen as the method needs."""
        spec = self.card.specs.get(name)
        if spec is None:
            return [f"the card has no {name!r} ({role}){hint}"]
        problems = []
        own = self.arch
        if spec.arch not in ADAPTERS or (own in ADAPTERS and ADAPTERS[spec.arch] is not ADAPTERS[own]):
            problems.append(f"{name!r} ({role}) has arch {spec.arch!r}; it must be a generator run like "
                            f"{self.transformer!r} ({own!r})")
        if trainable and not spec.trainable:
            problems.append(f"{name!r} ({role}) trains: set `trainable: true` and give it an optimizer")
        if not trainable and spec.trainable:
            problems.append(f"{name!r} ({role}) must be frozen: set `trainable: false` and drop its optimizer")
        return problems

    # ------------------------------------------------------------------ conditioning
    def condition(self, prompts: list[str], device: Optional[torch.device] = None, *,
                  images: Optional[torch.Tensor] = None, size: Optional[VideoSize] = None) -> Conditioning:
        """The conditioning of ``prompts`` (text rows cached by encoder version and prompt) and, for an
        image-to-video generator, of the first frames ``images`` (B, 3, H, W) in [-1, 1] of ``size`` videos."""
        return self.conditioning(prompts, 1.0, device, images=images, size=size)[0]

    def conditioning(self, prompts: list[str], guidance_scale: float, device: Optional[torch.device] = None, *,
                     images: Optional[torch.Tensor] = None, size: Optional[VideoSize] = None
                     ) -> tuple[Conditioning, Optional[Conditioning]]:
        """``prompts``' conditioning and, when CFG is on, the empty prompt's with the same image (the
        pipelines' negative pass swaps only the text)."""
        adapter = self.adapter
        if adapter.takes_image and (images is None or size is None):
            raise ValueError(f"{type(adapter).__name__} ({self.transformer!r}) generates from a first frame: give "
                             f"it images (an image-producing stage before it in a workflow, or an `image`/`video` "
                             f"in the batch)")
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"{len(images)} conditioning images for {len(prompts)} prompts")
        rest = adapter.extra(self, len(prompts))
        if images is not None:
            rest.update(adapter.image(self, images.to(device) if device is not None else images, size))
        cond = Conditioning({**adapter.text(self, prompts), **rest}).to(device)
        if guidance_scale == 1.0:
            return cond, None
        return cond, Conditioning({**adapter.text(self, [""] * len(prompts)), **rest}).to(device)

    # ------------------------------------------------------------------ the transformer
    @contextlib.contextmanager
    def velocity(self, name: Optional[str] = None) -> Iterator[VelocityFn]:
        """The velocity function of component ``name`` (default: the stage's transformer); a LoRA
        reference runs the policy with its adapter off inside the context."""
        adapter = self.adapter
        with self.card.use(name or self.transformer) as module:
            yield lambda x, t, cond, **model_kwargs: adapter.velocity(module, x, t, cond, **model_kwargs)

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
