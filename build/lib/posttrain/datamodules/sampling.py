"""A data order that survives a kill: seeded per epoch, sharded per rank, resumable mid-epoch.

Lightning restores the loops after a crash but restarts an epoch's dataloader from its first batch.
``ResumableDataModule`` records how many batches of the current epoch were trained (``state_dict`` is
written into every checkpoint) and its sampler skips exactly those on resume, so the resumed run sees
the same batches in the same order as an uninterrupted one. The sampler is a ``DistributedSampler``
(Lightning leaves it in place under DDP) that shards a seeded permutation across ranks.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class ResumableSampler(DistributedSampler):
    def __init__(self, dataset: Dataset, shuffle: bool = True, seed: int = 0):
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        super().__init__(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=False)
        self.skip = 0  # samples of this rank's share to skip once, set on resume

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        skip, self.skip = self.skip, 0
        return iter(indices[skip:])


class ResumableDataModule(LightningDataModule):
    """Base of the training datamodules: a resumable sampler and the data position in checkpoints."""

    def __init__(self, batch_size: int, num_workers: int = 0, seed: int = 0):
        super().__init__()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self._resume_batches = 0
        self._resume_epoch: Optional[int] = None

    def train_dataset(self) -> Dataset:
        raise NotImplementedError

    def collate(self, items: list[dict]) -> dict:
        return torch.utils.data.default_collate(items)

    def train_dataloader(self) -> DataLoader:
        dataset = self.train_dataset()
        sampler = ResumableSampler(dataset, shuffle=True, seed=self.seed)
        if self._resume_epoch is not None and self.trainer is not None \
                and self.trainer.current_epoch == self._resume_epoch:
            sampler.skip = self._resume_batches * self.batch_size
        self._resume_epoch = None
        if len(sampler) < self.batch_size:
            raise ValueError(f"{type(self).__name__}: {len(dataset)} samples give this process {len(sampler)}, "
                             f"fewer than batch_size={self.batch_size}; add data or lower the batch size")
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler, drop_last=True,
                          num_workers=self.num_workers, collate_fn=self.collate,
                          persistent_workers=self.num_workers > 0)

    def state_dict(self) -> dict:
        if self.trainer is None:
            return {}
        progress = self.trainer.fit_loop.epoch_loop.batch_progress.current
        return {"epoch": self.trainer.current_epoch, "batches": progress.processed}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self._resume_epoch = state["epoch"]
            self._resume_batches = state["batches"]
