"""Training on rows precomputed by ``posttrain preprocess``: VAE latents and frozen text-encoder rows.

    posttrain fit --config configs/finetune.yaml --data PrecomputedVideos --data.path runs/precomputed

Batches carry ``latents`` (what finetune would encode from ``video``), ``prompt``, and ``text_embeds``
{encoder: rows}; the method puts the rows in the card's embedding cache before the step, so its text
encoders are not run on them. With the same ``batch_size`` and ``seed`` as the datamodule the rows were
made from, batches hold the same samples in the same order, and training is bitwise the on-the-fly run at equal CPU threads
(tests/test_precomputed.py). At start-up the method refuses rows made by other weights, at another video
size or text length (``callbacks.precomputed.PrecomputedRows``).

With this data ``posttrain fit`` does not load the frozen text encoders whose rows the folder holds
(``Expert.precomputed``, set by ``lit.tools.config.apply_precomputed``): the rows of the empty prompt and of the
prompts the run samples (``text_rows``) come from the folder too.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils.data import DataLoader, Dataset

from posttrain.datamodules.sampling import ResumableDataModule
from posttrain.modules.io import batch as batch_schema
from posttrain.modules.io.precomputed import SAMPLES, PrecomputedSplit, read_manifest


class PrecomputedDataset(Dataset):
    def __init__(self, split: PrecomputedSplit):
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, index: int) -> dict:
        item = batch_schema.item(self.split.prompts[index], index,
                                 text_embeds={name: rows[index] for name, rows in self.split.text.items()})
        if self.split.latents is not None:
            item["latents"] = self.split.latents[index]
        return item


class PrecomputedVideos(ResumableDataModule):
    """Args:
        path: a folder written by ``posttrain preprocess``.
        batch_size, num_workers, seed: loader settings (as the datamodule the rows came from, for the
            same order).
    """

    def __init__(self, path: str, batch_size: int = 4, num_workers: int = 0, seed: int = 0):
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        self.path = path
        self.manifest = read_manifest(path)  # a wrong path fails at start-up
        self._splits: dict[str, PrecomputedSplit] = {}

    def split(self, name: str) -> PrecomputedSplit:
        """A split's rows (``train``, ``val``), or those of the prompts the config's callbacks sample (``samples``)."""
        if name not in self._splits:
            manifest = {"splits": {SAMPLES: self.manifest[SAMPLES]}} if name == SAMPLES else self.manifest
            self._splits[name] = PrecomputedSplit(self.path, name, manifest)
        return self._splits[name]

    @property
    def empty_text_embeds(self) -> dict:
        """{encoder: (1, ...)} rows of the empty prompt."""
        return self.split("train").empty

    def train_dataset(self) -> Dataset:
        return PrecomputedDataset(self.split("train"))

    def text_rows(self, prompts: list[str]) -> tuple[list[str], dict[str, torch.Tensor]]:
        """(those of ``prompts`` the rows hold, {encoder: (n, ...) their rows}), from the callbacks' sample prompts, the
        validation split or the training split; only those rows are gathered (a UMT5 row at 512×4096 bf16 is 4 MiB)."""
        where: dict[str, tuple[PrecomputedSplit, int]] = {}
        names = [s for s in ("train", "val") if s in self.manifest["splits"]]
        for name in names + ([SAMPLES] if SAMPLES in self.manifest else []):
            split = self.split(name)
            index = {prompt: i for i, prompt in enumerate(split.prompts)}
            where.update({p: (split, index[p]) for p in prompts if p in index})
        found = [p for p in dict.fromkeys(prompts) if p in where]
        if not found:
            return [], {}
        return found, {name: torch.stack([split.text[name][i] for split, i in (where[p] for p in found)])
                       for name in self.split("train").text}

    def sample_prompts(self, k: int) -> list[str]:
        """The first ``k`` prompts of the validation rows, or of the training rows when there are none."""
        return list(self.split("val" if "val" in self.manifest["splits"] else "train").prompts[:k])

    def val_dataloader(self) -> Optional[DataLoader]:
        if "val" not in self.manifest["splits"]:
            return None
        return DataLoader(PrecomputedDataset(self.split("val")), batch_size=self.batch_size,
                          num_workers=self.num_workers)
