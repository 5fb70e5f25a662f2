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
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class ResumableSampler(DistributedSampler):
    """``num_replicas`` / ``rank``: those of the process group (None: read from it; 1 and 0 without one)."""

    def __init__(self, dataset: Dataset, shuffle: bool = True, seed: int = 0, num_replicas: Optional[int] = None,
                 rank: Optional[int] = None):
        grouped = dist.is_available() and dist.is_initialized()
        world = num_replicas if num_replicas is not None else dist.get_world_size() if grouped else 1
        rank = rank if rank is not None else dist.get_rank() if grouped else 0
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
        saved = (state["batch_size"], state["replicas"], state["dataset"])
        now = (self.batch_size, self.sampler.num_replicas, len(self.dataset))
        per_process = -(-state["dataset"] // state["replicas"])  # DistributedSampler's share (padded)
        if done >= per_process // state["batch_size"]:  # saved on the epoch's last batch: the next one starts
            epoch, done = epoch + 1, 0
        elif saved != now:
            done = self._carry_over(epoch, done, saved, now)
        self.sampler.set_epoch(epoch)
        self.sampler.resume = (epoch, done * self.batch_size)
        self.epoch, self.position = epoch, done

    def _carry_over(self, epoch: int, done: int, saved: tuple, now: tuple) -> int:
        """Batches of this process's share to skip when the checkpoint was written at another world size or batch
        size, said in one line. Every world size shards the same seeded permutation of the epoch (rank r takes
        every W-th index from r), so the samples ``done`` batches drew on every process are its first
        ``done·B·W``: this run skips the largest number of its batches that stays within them — exactly them when
        the count divides, else the rest of them are drawn again. Another dataset has another permutation."""
        (batch, replicas, samples), (new_batch, new_replicas, new_samples) = saved, now
        consumed = done * batch * replicas
        skip = consumed // new_replicas // new_batch
        covered = skip * new_batch * new_replicas
        position = (f"the checkpoint stopped after {consumed} samples of epoch {epoch} ({replicas} processes x batch "
                    f"{batch}); this run has {new_replicas} x {new_batch}")
        if samples != new_samples:
            rank_zero_warn(f"{position} and {new_samples} samples instead of {samples}: another permutation, so epoch "
                           f"{epoch} continues after {covered} of its samples, not the ones the checkpoint had drawn")
        elif covered == consumed:
            rank_zero_info(f"{position}: epoch {epoch} continues after exactly those samples")
        else:
            rank_zero_warn(f"{position}: epoch {epoch} continues after {covered} of those samples (the last batch "
                           f"boundary at this size), so {consumed - covered} of them are drawn again")
        return skip


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
        # the strategy's data-parallel ranks (a sequence-parallel group shares its samples); the group's otherwise
        strategy = self.trainer.strategy if self.trainer is not None else None
        ranks = getattr(strategy, "distributed_sampler_kwargs", None) or {}
        sampler = ResumableSampler(dataset, shuffle=True, seed=self.seed, num_replicas=ranks.get("num_replicas"),
                                   rank=ranks.get("rank"))
        if len(sampler) < self.batch_size:
            raise ValueError(f"{type(self).__name__}: {len(dataset)} samples give this process {len(sampler)}, "
                             f"fewer than batch_size={self.batch_size}; add data or lower the batch size")
        # batches in page-locked memory when the run trains on a GPU: Lightning then copies them non-blocking, so
        # the next batch's copy overlaps the step (with workers, a pinning thread prepares them ahead)
        pin = strategy is not None and strategy.root_device.type == "cuda"
        return ResumableLoader(dataset, batch_size=self.batch_size, sampler=sampler, seed=self.seed,
                               num_workers=self.num_workers, collate_fn=self.collate,
                               persistent_workers=self.num_workers > 0, pin_memory=pin)
