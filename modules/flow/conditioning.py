"""What a generator reads besides its noisy latents, as one structure indexed as a whole.

A ``Conditioning`` maps names to batched tensors whose first dimension is the sample: Wan T2V has
``encoder_hidden_states`` (B, L, D); Wan I2V adds ``image_latents`` (B, 4 + C, F', h, w) (mask and
image latents); FLUX has ``encoder_hidden_states`` (B, L, D), ``pooled_projections`` (B, D) and, for
guidance-distilled weights, ``guidance`` (B,). Methods select, repeat and concatenate conditionings
with the methods below, never one tensor of them, so an image condition can never be paired with the
wrong text row. The generator adapter (``modules.generators``) defines which names it holds.
"""
from __future__ import annotations

from typing import Iterable, Union

import torch


class Conditioning(dict):
    """Named tensors of one batch, all with the batch as their first dimension."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        sizes = {name: value.shape[0] for name, value in self.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"conditioning tensors disagree on the batch size: {sizes}")

    @property
    def batch_size(self) -> int:
        return next(iter(self.values())).shape[0]

    def select(self, index: Union[torch.Tensor, slice, list[int]]) -> "Conditioning":
        """The rows ``index`` of every tensor."""
        return Conditioning({name: value[index.to(value.device) if isinstance(index, torch.Tensor) else index]
                             for name, value in self.items()})

    def repeat_interleave(self, repeats: int) -> "Conditioning":
        """Each row ``repeats`` times in place (a group of K samples of one prompt)."""
        return Conditioning({name: value.repeat_interleave(repeats, dim=0) for name, value in self.items()})

    def to(self, *args, **kwargs) -> "Conditioning":
        return Conditioning({name: value.to(*args, **kwargs) for name, value in self.items()})

    @staticmethod
    def cat(parts: Iterable["Conditioning"]) -> "Conditioning":
        """Row-wise concatenation (e.g. conditional and unconditional rows of one CFG forward)."""
        parts = list(parts)
        names = set(parts[0])
        if any(set(p) != names for p in parts):
            raise ValueError(f"cannot concatenate conditionings with different names: {[sorted(p) for p in parts]}")
        return Conditioning({name: torch.cat([p[name] for p in parts]) for name in parts[0]})
