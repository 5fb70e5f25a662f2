"""The batch schema: what every datamodule's items hold and the one way methods read it.

An item (one row of a dataset) is a dict with

- ``prompt`` (str): the text the generator is conditioned on (a caption, a prompt, a user request);
- ``index`` (int): the item's position in its dataset, the same on every process. ``predict`` draws the noise
  of a batch from a generator seeded with its first index, so a sample does not depend on the batch size;
- ``group`` (int): the item's group key. An RL method rolls K samples out of each item; their rewards are
  normalized among the samples of one group key, gathered across processes (a group split over ranks is still
  one group). The datamodules here set it to ``index``: each item is its own group;

and, depending on the datamodule, ``video`` (3, F, H, W) in [-1, 1], ``latents`` (C, F', h, w), ``image``
(3, H, W) (a first frame for an image-to-video generator) and ``text_embeds`` {encoder: rows} (``posttrain
preprocess``). The default collation makes a batch of them: ``prompt`` a list of B strings, ``index`` and
``group`` (B,) long tensors.
"""
from __future__ import annotations

from typing import Any

import torch

PROMPT, INDEX, GROUP = "prompt", "index", "group"


def item(prompt: str, index: int, **fields: Any) -> dict[str, Any]:
    """One dataset item of the schema: ``prompt``, ``index``, ``group`` (= ``index``) and ``fields``."""
    return {PROMPT: prompt, INDEX: index, GROUP: index, **fields}


def prompts(batch: dict, method: str) -> list[str]:
    """The batch's prompts; an empty batch is refused, naming ``method``."""
    values = list(batch[PROMPT])
    if not values:
        raise ValueError(f"{method}: the batch holds no prompts")
    return values


def group_ids(batch: dict, repeats: int = 1) -> torch.Tensor:
    """(B·repeats,) long group keys, each row's repeated ``repeats`` times in place (a group of K samples)."""
    return torch.as_tensor(batch[GROUP], dtype=torch.long).repeat_interleave(repeats)


def seed(batch: dict, default: int) -> int:
    """The noise seed of a ``predict`` batch: its first item's ``index`` (``default`` for a batch without one)."""
    indices = batch.get(INDEX)
    return int(indices[0]) if indices is not None and len(indices) else default
