"""A data order that survives a kill: seeded per epoch, sharded per rank, resumable at any batch.

The training loader follows Lightning's stateful-dataloader protocol: ``ResumableLoader.state_dict()`` (the
epoch and the number of batches of it handed out) goes into every checkpoint through the fit loop, and
``load_state_dict`` makes the next iterator continue exactly there — the remaining batches of that epoch, or,
when the checkpoint was taken on an epoch's last batch, the next epoch from its first batch. The sampler is a
``DistributedSampler`` (Lightning leaves it in place under DDP) that shards a seeded permutation across ranks.

``BucketSampler`` / ``BucketLoader`` are the same protocol for items of several shapes (aspect-ratio and frame-count
buckets): every batch holds items of one bucket, and the plan of an epoch (which bucket each step draws, which items)
is a function of ``(seed, epoch)`` alone, so every rank computes the same plan and takes its own share of each step's
items, and a resumed run skips exactly the batches the checkpoint had trained.

The loaders never draw from the global torch RNG (a plain ``DataLoader`` draws a worker base seed from it on
every ``iter``): each has its own generator, reseeded from ``(seed, epoch)``, so a resumed run's global RNGs stay
those of the uninterrupted run.
"""
from __future__ import annotations

import hashlib
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class ResumableSampler(DistributedSampler):
    """``num_replicas`` / ``rank``: those of the process group (None: read from it; 1 and 0 without one).

    ``with_epoch``: yield ``(index, epoch)`` keys instead of indices, for a dataset whose items draw from the data
    position (a random frame window).
    """

    def __init__(self, dataset: Dataset, shuffle: bool = True, seed: int = 0, num_replicas: Optional[int] = None,
                 rank: Optional[int] = None, with_epoch: bool = False):
        world, rank = _replicas(num_replicas, rank)
        super().__init__(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=False)
        self.resume: Optional[tuple[int, int]] = None  # (epoch, samples of this rank's share to skip), once
        self.with_epoch = with_epoch

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        resume, self.resume = self.resume, None
        skip = resume[1] if resume is not None and resume[0] == self.epoch else 0
        if self.with_epoch:
            return iter([(i, self.epoch) for i in indices[skip:]])
        return iter(indices[skip:])


def _replicas(num_replicas: Optional[int], rank: Optional[int]) -> tuple[int, int]:
    """(world size, rank): those given, else the process group's (1 and 0 without one)."""
    grouped = dist.is_available() and dist.is_initialized()
    world = num_replicas if num_replicas is not None else dist.get_world_size() if grouped else 1
    return world, rank if rank is not None else dist.get_rank() if grouped else 0


class PositionedLoader(DataLoader):
    """A ``DataLoader`` that counts the batches of the current epoch it handed out (``epoch``, ``position``), for
    Lightning to checkpoint; its sampler carries ``epoch`` and ``resume = (epoch, done)`` of a restored position."""

    seed: int = 0

    def resumed_batches(self, done: int) -> int:
        """The batches already handed out when the sampler resumes ``done`` into the epoch."""
        return done

    def __iter__(self):
        sampler = self.sampler
        epoch = sampler.epoch
        start = self.resumed_batches(sampler.resume[1]) if sampler.resume and sampler.resume[0] == epoch else 0
        # worker base seeds from (seed, epoch), not from the global RNG
        self.generator.manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
        self.epoch, self.position = epoch, start  # batches of ``epoch`` handed out so far (skipped ones included)
        for batch in super().__iter__():
            self.position += 1
            yield batch


class ResumableLoader(PositionedLoader):
    """A ``DataLoader`` over a ``ResumableSampler`` whose position Lightning checkpoints (``state_dict``)."""

    def __init__(self, dataset: Dataset, batch_size: int, sampler: ResumableSampler, seed: int = 0, **kwargs: Any):
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=True,
                         generator=torch.Generator(), **kwargs)
        self.seed = seed
        self.epoch, self.position = 0, 0

    def resumed_batches(self, done: int) -> int:
        return done // self.batch_size  # the sampler resumes by samples

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


class BucketSampler(DistributedSampler):
    """Whole batches of one bucket each: per step, this rank's list of ``(index, epoch)`` keys.

    ``buckets`` holds the bucket of each dataset index (any sortable key, e.g. ``(frames, height, width)``). The plan
    of an epoch is a function of ``(seed, epoch)``: each bucket's indices are permuted and cut into steps of
    ``batch_size × num_replicas`` indices, and the steps of all buckets are shuffled together. A bucket's last step
    may hold fewer (``ceil(n / num_replicas)`` per rank, padded by wrapping round the bucket when ``n`` is not a
    multiple of the ranks, as ``DistributedSampler`` pads): nothing is dropped, so with one process every index is
    drawn exactly once per epoch. Every rank computes the same plan and takes every ``num_replicas``-th index of
    each step from its own rank, so the ranks of a step agree on its bucket. Being a ``DistributedSampler``, it is
    left in place by Lightning under DDP.
    """

    def __init__(self, buckets: list, batch_size: int, shuffle: bool = True, seed: int = 0,
                 num_replicas: Optional[int] = None, rank: Optional[int] = None):
        world, rank = _replicas(num_replicas, rank)
        super().__init__(buckets, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=False)
        self.buckets, self.batch_size = list(buckets), batch_size
        self.resume: Optional[tuple[int, int]] = None  # (epoch, steps to skip), once

    def groups(self) -> dict[Any, list[int]]:
        """bucket -> its dataset indices, ascending."""
        groups: dict[Any, list[int]] = {}
        for index, bucket in enumerate(self.buckets):
            groups.setdefault(bucket, []).append(index)
        return groups

    def steps(self, epoch: int) -> list[tuple[Any, list[int]]]:
        """(bucket, indices of every rank) of each step of ``epoch``, in order."""
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        per_step = self.batch_size * self.num_replicas
        steps = []
        for bucket, indices in sorted(self.groups().items()):
            if self.shuffle:
                indices = [indices[i] for i in torch.randperm(len(indices), generator=g).tolist()]
            for start in range(0, len(indices), per_step):
                chunk = indices[start:start + per_step]
                short = -len(chunk) % self.num_replicas
                chunk += (indices * (short // len(indices) + 1))[:short]
                steps.append((bucket, chunk))
        if self.shuffle:
            steps = [steps[i] for i in torch.randperm(len(steps), generator=g).tolist()]
        return steps

    def __len__(self) -> int:
        per_step = self.batch_size * self.num_replicas
        return sum(-(-len(indices) // per_step) for indices in self.groups().values())

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        steps = self.steps(self.epoch)
        resume, self.resume = self.resume, None
        skip = resume[1] if resume is not None and resume[0] == self.epoch else 0
        for _, chunk in steps[skip:]:
            yield [(index, self.epoch) for index in chunk[self.rank::self.num_replicas]]

    def fingerprint(self) -> str:
        """What fixes the plan besides (seed, epoch): the bucket of every index, the batch size, the ranks."""
        digest = hashlib.sha256(repr((self.buckets, self.batch_size, self.num_replicas, self.shuffle)).encode())
        return digest.hexdigest()[:16]


class Batched(Dataset):
    """A dataset read a whole batch at a time: ``[dataset[k] for k in keys]`` (what a ``BucketSampler`` yields)."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, keys: list) -> list:
        return [self.dataset[k] for k in keys]


class BucketLoader(PositionedLoader):
    """``ResumableLoader`` for a ``BucketSampler``: batches of one bucket, their position checkpointed by Lightning.

    The sampler yields whole batches, so the loader runs without automatic batching (``batch_size=None``) and
    ``collate_fn`` makes one batch of each step's items (a worker loads a whole batch)."""

    def __init__(self, dataset: Dataset, sampler: BucketSampler, collate_fn: Any, seed: int = 0, **kwargs: Any):
        super().__init__(Batched(dataset), batch_size=None, sampler=sampler, collate_fn=collate_fn,
                         generator=torch.Generator(), **kwargs)
        self.seed = seed
        self.epoch, self.position = 0, 0  # the sampler resumes by steps: the default ``resumed_batches``

    def state_dict(self) -> dict[str, Any]:
        sampler: BucketSampler = self.sampler
        return {"epoch": self.epoch, "batches": self.position, "batch_size": sampler.batch_size,
                "replicas": sampler.num_replicas, "dataset": len(sampler.buckets), "steps": len(sampler),
                "plan": sampler.fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sampler: BucketSampler = self.sampler
        epoch, done = state["epoch"], state["batches"]
        if done >= state["steps"]:  # saved on the epoch's last step: the next epoch starts
            epoch, done = epoch + 1, 0
        elif state["plan"] != sampler.fingerprint():
            # another plan (other data, batch size or world size): the same share of the epoch, said once
            skip = done * len(sampler) // state["steps"]
            rank_zero_warn(f"the checkpoint stopped after {done} of {state['steps']} bucket batches of epoch {epoch} "
                           f"({state['replicas']} processes x batch {state['batch_size']}, {state['dataset']} "
                           f"samples); this run ({sampler.num_replicas} x {sampler.batch_size}, {len(sampler.buckets)} "
                           f"samples) plans its batches differently, so epoch {epoch} continues after {skip} of its "
                           f"{len(sampler)} batches, not after the samples the checkpoint had drawn")
            done = skip
        sampler.set_epoch(epoch)
        sampler.resume = (epoch, done)
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

    def sample_prompts(self, k: int) -> list[str]:
        """The first ``k`` prompts of the validation split, which ``callbacks.SampleVideos`` draws when it is given
        none; [] without one. Read from the first batches of ``val_dataloader``: a module that knows its captions
        without loading media says so more cheaply."""
        if not is_overridden("val_dataloader", self, LightningDataModule):
            return []
        loaders = self.val_dataloader()
        prompts: list[str] = []
        for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders] if loaders is not None else []:
            for batch in loader:
                if not isinstance(batch, dict):  # not the batch schema: no prompts to read
                    break
                prompts += [str(p) for p in batch.get("prompt", [])]
                if len(prompts) >= k:
                    return prompts[:k]
        return prompts

    def collate(self, items: list[dict]) -> dict:
        return torch.utils.data.default_collate(items)

    keys_with_epoch = False  # the sampler yields (index, epoch): items that draw from the data position

    def data_parallel_ranks(self) -> dict[str, Optional[int]]:
        """``num_replicas`` and ``rank`` of the strategy's data-parallel ranks (a sequence-parallel group shares its
        samples); None for both outside a trainer (the process group's then)."""
        strategy = self.trainer.strategy if self.trainer is not None else None
        ranks = getattr(strategy, "distributed_sampler_kwargs", None) or {}
        return {"num_replicas": ranks.get("num_replicas"), "rank": ranks.get("rank")}

    def pin_memory(self) -> bool:
        """Batches in page-locked memory when the run trains on a GPU: Lightning then copies them non-blocking, so
        the next batch's copy overlaps the step (with workers, a pinning thread prepares them ahead)."""
        strategy = self.trainer.strategy if self.trainer is not None else None
        return strategy is not None and strategy.root_device.type == "cuda"

    def train_dataloader(self) -> DataLoader:
        dataset = self.train_dataset()
        sampler = ResumableSampler(dataset, shuffle=True, seed=self.seed, with_epoch=self.keys_with_epoch,
                                   **self.data_parallel_ranks())
        if len(sampler) < self.batch_size:
            raise ValueError(f"{type(self).__name__}: {len(dataset)} samples give this process {len(sampler)}, "
                             f"fewer than batch_size={self.batch_size}; add data or lower the batch size")
        return ResumableLoader(dataset, batch_size=self.batch_size, sampler=sampler, seed=self.seed,
                               num_workers=self.num_workers, collate_fn=self.collate,
                               persistent_workers=self.num_workers > 0, pin_memory=self.pin_memory())
