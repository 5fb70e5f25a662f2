"""A data order that survives a kill: seeded per epoch, sharded per rank, resumable at any batch.

The training loader follows Lightning's stateful-dataloader protocol: ``ResumableLoader.state_dict()`` (the
epoch and the number of batches of it handed out) goes into every checkpoint through the fit loop, and
``load_state_dict`` makes the next iterator continue exactly there — the remaining batches of that epoch, or,
when the checkpoint was taken on an epoch's last batch, the next epoch from its first batch. The sampler is a
``DistributedSampler`` (Lightning leaves it in place under DDP) that shards a seeded permutation across ranks.

The loader never draws from the global torch RNG (a plain ``DataLoader`` draws a worker base seed from it on
every ``iter``): its own generator is reseeded from ``(seed, epoch)``, so a resumed run's global RNGs stay
those of the uninterrupted run.
"""
from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class ResumableSampler(DistributedSampler):
    def __init__(self, dataset: Dataset, shuffle: bool = True, seed: int = 0):
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        super().__init__(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=False)
        self.resume: Optional[tuple[int, int]] = None  # (epoch, samples of this rank's share to skip), once

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        resume, self.resume = self.resume, None
        skip = resume[1] if resume is not None and resume[0] == self.epoch else 0
        return iter(indices[skip:])


class ResumableLoader(DataLoader):
    """A ``DataLoader`` over a ``ResumableSampler`` whose position Lightning checkpoints (``state_dict``)."""

    def __init__(self, dataset: Dataset, batch_size: int, sampler: ResumableSampler, seed: int = 0, **kwargs: Any):
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=True,
                         generator=torch.Generator(), **kwargs)
        self.seed = seed
        self.epoch, self.position = 0, 0  # batches of ``epoch`` handed out so far (skipped ones included)

    def __iter__(self):
        sampler: ResumableSampler = self.sampler
        epoch = sampler.epoch
        start = sampler.resume[1] // self.batch_size if sampler.resume and sampler.resume[0] == epoch else 0
        # worker base seeds from (seed, epoch), not from the global RNG
        self.generator.manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
        self.epoch, self.position = epoch, start
        for batch in super().__iter__():
            self.position += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches": self.position, "batch_size": self.batch_size,
                "replicas": self.sampler.num_replicas, "dataset": len(self.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, done = state["epoch"], state["batches"]
        if done >= len(self):  # saved on the epoch's last batch: the next epoch starts from its first
            epoch, done = epoch + 1, 0
        saved = (state["batch_size"], state["replicas"], state["dataset"])
        if saved != (self.batch_size, self.sampler.num_replicas, len(self.dataset)):
            # another batch size, world size or dataset: continue after the same share of the epoch's samples
            consumed = done * state["batch_size"] * state["replicas"]
            done = consumed // self.sampler.num_replicas // self.batch_size
            rank_zero_warn(f"the checkpoint's data position is for batch_size, processes, samples = {saved}, this "
                           f"run has {(self.batch_size, self.sampler.num_replicas, len(self.dataset))}: epoch "
                           f"{epoch} continues after about {consumed} samples, not exactly where it stopped")
        self.sampler.set_epoch(epoch)
        self.sampler.resume = (epoch, done * self.batch_size)
        self.epoch, self.position = epoch, done


class ResumableDataModule(LightningDataModule):
    """Base of the training datamodules: a resumable training loader."""

    def __init__(self, batch_size: int, num_workers: int = 0, seed: int = 0):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data: batch_size={batch_size} must be >= 1 (samples per process and iteration)")
        if num_workers < 0:
            raise ValueError(f"data: num_workers={num_workers} must be >= 0 (0 loads in the training process)")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed

    def train_dataset(self) -> Dataset:
        raise NotImplementedError

    def collate(self, items: list[dict]) -> dict:
        return torch.utils.data.default_collate(items)

    def train_dataloader(self) -> DataLoader:
        dataset = self.train_dataset()
        sampler = ResumableSampler(dataset, shuffle=True, seed=self.seed)
        if len(sampler) < self.batch_size:
            raise ValueError(f"{type(self).__name__}: {len(dataset)} samples give this process {len(sampler)}, "
                             f"fewer than batch_size={self.batch_size}; add data or lower the batch size")
        return ResumableLoader(dataset, batch_size=self.batch_size, sampler=sampler, seed=self.seed,
                               num_workers=self.num_workers, collate_fn=self.collate,
                               persistent_workers=self.num_workers > 0)
