"""What every generator adapter is: the interface a family implements, and the video size.

A family file (``wan.py``, ``flux.py``, …) subclasses ``GeneratorAdapter`` after its diffusers pipeline.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from posttrain.modules.conditioning import Conditioning
from posttrain.modules.samplers import FlowMatchSampler

if TYPE_CHECKING:
    from posttrain.modules.generators import GeneratorStage


@dataclass(frozen=True)
class VideoSize:
    """Pixel size of what a method generates (rollouts, sample videos, ``predict``). An image is a
    one-frame video. Wan's VAE needs ``frames = 4k + 1``; height and width must be multiples of the VAE's
    spatial factor times the transformer's patch size (both read from the models' configs)."""

    frames: int = 9
    height: int = 32
    width: int = 32


def _config(model: torch.nn.Module):
    return model.config


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
        new_cache = getattr(transformer, "new_cache", None)
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
