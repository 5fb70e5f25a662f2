"""User requests of the synthetic world with the facts they ask for (``modules/world/requests.py``), for RL.

Request ``index`` asks for the facts of synthetic video ``index`` (``ShapesDataset.facts``: the same
seed gives the same facts, ``exclude``/``include`` filter them as for the videos) and is written in the
split's words and templates from its own generator, so every request is a pure function of
``(seed, index, split)``. A batch carries, beside the schema's ``prompt`` (the request), ``index`` and ``group``
(``posttrain.modules.io.batch``), the canonical ``caption`` and one string per fact
(``shape``, ``colour``, ``background``, ``motion``; ``""`` where the request leaves the fact out), which
``modules.requests.facts_from_batch`` turns back into ``Facts`` for ``IntentReward``.
"""
from __future__ import annotations

from typing import Literal, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from posttrain.datamodules.sampling import ResumableDataModule
from posttrain.datamodules.synthetic import ShapesDataset
from posttrain.modules.io import batch as batch_schema
from posttrain.modules.world.requests import write_request
from posttrain.modules.world.world import FACTS, Facts


class RequestDataset(Dataset):
    """``num_requests`` requests of ``split``, indices ``start`` … ``start + num_requests - 1``."""

    def __init__(self, num_requests: int, seed: int = 0, split: Literal["train", "eval"] = "train",
                 drop_rate: float = 0.25, exclude: Sequence[str] = (), include: Sequence[str] = (), start: int = 0):
        self.facts = ShapesDataset(max(num_requests, 1), 1, 8, 8, seed, exclude=exclude, include=include)
        self.num_requests, self.seed, self.split = num_requests, seed, split
        self.drop_rate, self.start = drop_rate, start
        self.request(0)  # check split and drop_rate at start-up

    def __len__(self) -> int:
        return self.num_requests

    def request(self, index: int):
        shape, colour, motion, background = self.facts.facts(self.start + index)
        rng = torch.Generator().manual_seed(self.seed * 1_000_033 + self.start + index)
        return write_request(Facts(shape, colour, background, motion), rng, self.split, self.drop_rate)

    def __getitem__(self, index: int) -> dict:
        request = self.request(index)
        return batch_schema.item(request.text, self.start + index, caption=request.caption,
                                 **{f: getattr(request.facts, f) or "" for f in FACTS})


class Requests(ResumableDataModule):
    """User requests (train split) for rollout methods, with their facts in the batch.

    Args:
        num_requests: training requests (indices 0 … num_requests - 1).
        val_requests: validation requests, the indices after the training ones.
        val_split: the validation requests' wording: ``held_out`` (words and templates no training request
            uses) or ``seen`` (the training grammar, other requests).
        drop_rate: share of requests that leave one fact out (colour, background or motion).
        exclude, include: concepts the facts must not / must show (as ``SyntheticVideos``; e.g. ``magenta``,
            the colour the shipped generator never saw).
        batch_size: requests per iteration (each a group of K samples in RL).
        seed: the facts, the wording and the order.
    """

    def __init__(self, num_requests: int = 64, val_requests: int = 8,
                 val_split: Literal["held_out", "seen"] = "held_out", drop_rate: float = 0.25, batch_size: int = 2,
                 num_workers: int = 0, seed: int = 0, exclude: Sequence[str] = (), include: Sequence[str] = ()):
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        problems = []
        if num_requests < 1:
            problems.append(f"num_requests={num_requests} must be >= 1")
        if val_requests < 1:
            problems.append(f"val_requests={val_requests} must be >= 1")
        if val_split not in ("held_out", "seen"):
            problems.append(f"val_split={val_split!r}: choose 'held_out' or 'seen'")
        if problems:
            raise ValueError("Requests: " + "; ".join(problems))
        self.num_requests, self.val_requests, self.val_split = num_requests, val_requests, val_split
        self.drop_rate, self.exclude, self.include = drop_rate, list(exclude), list(include)
        self.dataset(1, "train")  # check drop_rate, exclude and include at start-up

    def dataset(self, num: int, split: Literal["train", "eval"], start: int = 0) -> RequestDataset:
        return RequestDataset(num, self.seed, split, self.drop_rate, self.exclude, self.include, start)

    def train_dataset(self) -> Dataset:
        return self.dataset(self.num_requests, "train")

    def val_dataloader(self) -> DataLoader:
        split = "eval" if self.val_split == "held_out" else "train"
        dataset = self.dataset(self.val_requests, split, start=self.num_requests)
        return DataLoader(dataset, batch_size=self.batch_size, num_workers=self.num_workers)

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()
