"""CLIPScore through torchmetrics, from a local ``transformers`` CLIP folder (nothing is downloaded).

``clip_score_metric(path)`` is torchmetrics' ``CLIPScore`` (``100 · max(cos(image, text), 0)``, averaged, its
states summed across processes) over the folder's ``CLIPModel`` and ``CLIPProcessor``; ``clip_cosines`` is
the same computation per sample (torchmetrics' update function), which the ``CLIPScore`` reward reads. The
model is wrapped so that ``get_image_features``/``get_text_features`` return tensors: transformers 5 returns
an output object (the projected embedding in ``pooler_output``), which torchmetrics 1.x does not read.
"""
from __future__ import annotations

import os

import torch
from torch import nn


class _ProjectedFeatures(nn.Module):
    """A ``CLIPModel`` whose feature methods return the projected embeddings as tensors."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.config = model.config

    @staticmethod
    def _tensor(out):
        return out if isinstance(out, torch.Tensor) else out.pooler_output

    def get_image_features(self, *args, **kwargs) -> torch.Tensor:
        return self._tensor(self.model.get_image_features(*args, **kwargs))

    def get_text_features(self, *args, **kwargs) -> torch.Tensor:
        return self._tensor(self.model.get_text_features(*args, **kwargs))


def load_clip(path: str, what: str = "CLIPScore") -> tuple[nn.Module, object]:
    """(model, processor) of a local CLIP folder, frozen; a clear error when it is not one."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{what}: path={path!r} is not a local folder; give the folder of a transformers "
                                f"CLIP model and its processor (CLIPModel/CLIPProcessor.save_pretrained), nothing "
                                f"is downloaded")
    from transformers import CLIPModel, CLIPProcessor

    try:
        model = CLIPModel.from_pretrained(path, local_files_only=True)
        processor = CLIPProcessor.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"{what}: {path!r} does not hold a CLIP model with its processor (tokenizer and image "
                         f"processor files): {str(err).splitlines()[0]}") from err
    return _ProjectedFeatures(model.eval().requires_grad_(False)), processor


def clip_score_metric(path: str):
    """torchmetrics' ``CLIPScore`` over the CLIP folder ``path`` (loaded now: a bad folder fails at start-up)."""
    from torchmetrics.multimodal.clip_score import CLIPScore

    loaded = load_clip(path)
    return CLIPScore(model_name_or_path=lambda: loaded)


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """(N, 3, H, W) in [-1, 1] -> uint8 in [0, 255] (what the CLIP processor rescales)."""
    return ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


@torch.no_grad()
def clip_cosines(model: nn.Module, processor, images: torch.Tensor, texts: list[str]) -> torch.Tensor:
    """(N,) cosine similarities of (N, 3, H, W) images in [-1, 1] and their texts (torchmetrics' per-sample
    score / 100, not clamped at 0)."""
    from torchmetrics.functional.multimodal.clip_score import _clip_score_update

    score, _ = _clip_score_update(list(to_uint8(images)), list(texts), model, processor)  # model to their device
    return score.float() / 100
