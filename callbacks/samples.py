"""Sample videos of the run's own prompts every N iterations, through the same sampler as ``predict`` and every rollout.

Which prompts, decided once at the start of fit and said in one line: ``prompts``; else the lines of
``prompts_file``; else the first ``num_prompts`` prompts the data offers (its ``sample_prompts``: the captions of its
validation split — a folder's held-out captions, the synthetic world's validation captions, the first prompts of a
prompt list); the world's two shape prompts only when the data offers none. An image-to-video generator (a method's
``reads_first_frames``) samples the first ``num_prompts`` rows of the data's validation split instead, each from its
caption and its first frame (the method's ``first_frames``: the clip's image, or its cached latents').

Each data-parallel rank generates its share of the prompts (a contiguous slice; the ranks of a sequence-parallel
group share one), every rank the same number of them, padded with a repeat: a ZeRO-3 expert gathers its weights
with every rank in each forward. Rank 0 gathers the videos, writes and logs them. One process draws exactly the
noise it always drew (one generator seeded with ``seed``); on several, a share's noise is seeded with ``seed`` plus
the index of its first prompt, so the samples of a run are the same at every cadence but not those of one process.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from posttrain.datamodules.prompts import read_prompts
from posttrain.modules.io.media import gif_bytes, slug, write_media

DEFAULT_PROMPTS = ("a red circle moving left on a blue background",
                   "a yellow square moving down on a magenta background")


def prompt_shares(count: int, parts: int) -> list[tuple[list[int], int]]:
    """(prompt indices, how many of them are real) for each of ``parts`` data-parallel ranks.

    Contiguous shares whose sizes differ by at most one, in rank order, each padded to ⌈count / parts⌉ with a repeat
    of its last prompt (of the list's last for an empty share): every rank runs generations of the same size, and
    the real indices of all shares, in order, are ``0 … count - 1``. E.g. 3 prompts over 2 ranks:
    ``[([0, 1], 2), ([2, 2], 1)]``."""
    if count < 1 or parts < 1:
        raise ValueError(f"prompt_shares: count={count} and parts={parts} must be >= 1")
    width = -(-count // parts)
    shares, start = [], 0
    for part in range(parts):
        size = count // parts + (part < count % parts)
        indices = list(range(start, start + size))
        shares.append((indices + [indices[-1] if indices else count - 1] * (width - size), size))
        start += size
    return shares


class SampleVideos(Callback):
    """Generate a few prompts every ``every_n_iterations`` (and at the end, unless the last iteration was just
    sampled), log them to W&B as GIFs under ``samples/video`` with the prompt as caption, and write them under
    ``<log_dir>/samples`` when ``write_files``.

    Args:
        every_n_iterations: the cadence, in iterations.
        prompts: the prompts to draw; None = ``prompts_file``, else the data's.
        prompts_file: a ``.txt`` file of prompts, one a line (or a ``.jsonl`` of ``{"prompt": ...}``), instead of
            ``prompts``.
        num_prompts: how many prompts to take from the data when neither ``prompts`` nor ``prompts_file`` is given
            (the first of its validation split).
        seed: the noise seed (the same at every cadence, so samples of one run compare).
        fps: frame rate of the GIFs.
        write_files: also write each sample under ``<log_dir>/samples/it<iteration>_<i>_<prompt>.gif``.
        num_steps: denoising steps of the samples; None = the method's sampler's. Fewer steps make a cheaper look
            at a large model (a few-step student's step list is fixed: leave it None there).
        frames: frames of the samples; None = the method's ``run.frames`` (the VAE's rule holds: 4k+1 for Wan).
    """

    def __init__(self, every_n_iterations: int = 100, prompts: Optional[list[str]] = None,
                 prompts_file: Optional[str] = None, num_prompts: int = 4, seed: int = 0, fps: int = 8,
                 write_files: bool = True, num_steps: Optional[int] = None, frames: Optional[int] = None):
        problems = []
        if every_n_iterations < 1:
            problems.append(f"every_n_iterations={every_n_iterations} must be >= 1")
        if prompts is not None and prompts_file is not None:
            problems.append("give `prompts` or `prompts_file`, not both")
        if prompts is not None and not [p for p in prompts if p.strip()]:
            problems.append("`prompts` is empty: list a few prompts, or drop it to draw the data's")
        if num_prompts < 1:
            problems.append(f"num_prompts={num_prompts} must be >= 1 (prompts taken from the data, e.g. 4)")
        if num_steps is not None and num_steps < 1:
            problems.append(f"num_steps={num_steps} must be >= 1, or null for the method's sampler's")
        if frames is not None and frames < 1:
            problems.append(f"frames={frames} must be >= 1, or null for the method's run.frames")
        if problems:
            raise ValueError("SampleVideos: " + "; ".join(problems))
        self.every = every_n_iterations
        self.prompts_file = prompts_file
        self.given: Optional[list[str]] = None  # the prompts of the config, None: the data's
        if prompts_file is not None:
            self.given = read_prompts(prompts_file)  # a missing or empty file stops here, at start-up
        elif prompts is not None:
            self.given = [p.strip() for p in prompts if p.strip()]
        self.num_prompts = num_prompts
        self.prompts: list[str] = list(self.given or DEFAULT_PROMPTS)  # resolved against the data at fit start
        self.first: dict[str, torch.Tensor] = {}  # image-to-video: each prompt's first frame (``first_frames``)
        self.seed, self.fps, self.write_files = seed, fps, write_files
        self.num_steps, self.frames = num_steps, frames
        self._last_sampled: Optional[int] = None  # the iteration sampled last in this process
        self._warned = False

    # ------------------------------------------------------------------ which prompts
    def resolve_prompts(self, datamodule: Any) -> tuple[list[str], str]:
        """(the prompts to draw, where they come from): ``prompts``, ``prompts_file``, the data's
        ``sample_prompts(num_prompts)``, or the world's two prompts when the data offers none."""
        if self.given is not None:
            return list(self.given), f"from {self.prompts_file}" if self.prompts_file else "given"
        offered = getattr(datamodule, "sample_prompts", None)
        found = [p for p in offered(self.num_prompts) if p.strip()][: self.num_prompts] if callable(offered) else []
        if found:
            return found, f"from the data ({type(datamodule).__name__})"
        return list(DEFAULT_PROMPTS), "of the synthetic world (the data offers none)"

    def drawn_prompts(self, datamodule: Any, video: Any) -> list[str]:
        """The prompts it samples: what a run that does not load its text encoder needs rows of (``posttrain
        preprocess`` encodes them, ``callbacks.precomputed`` caches them)."""
        return self.resolve_prompts(datamodule)[0]

    def validation_rows(self, datamodule: Any, pl_module) -> tuple[list[str], dict[str, torch.Tensor]]:
        """The captions and first frames (``pl_module.first_frames``) of the first ``num_prompts`` rows of the data's
        validation split: what an image-to-video generator samples from."""
        where = f"the generator ({pl_module.stage.transformer!r}) generates from a first frame"
        if self.given is not None:
            raise ValueError(f"SampleVideos: {where}, and {'prompts_file' if self.prompts_file else 'prompts'} give "
                             f"none: drop it to sample the data's validation clips (their captions and first frames)")
        loaders = datamodule.val_dataloader() if hasattr(datamodule, "val_dataloader") else None
        prompts, parts = [], []
        for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders] if loaders is not None else []:
            for batch in loader:
                if not isinstance(batch, dict) or len(prompts) >= self.num_prompts:
                    break
                take = min(len(batch["prompt"]), self.num_prompts - len(prompts))
                prompts += [str(p) for p in batch["prompt"][:take]]
                parts.append({key: value[:take].cpu() for key, value in pl_module.first_frames(batch).items()})
        if not prompts:
            raise ValueError(f"SampleVideos: {where}, and the data ({type(datamodule).__name__}) has no validation "
                             f"clips to take them from: give it a validation split (VideoFolder: val_fraction or "
                             f"val_files), or drop SampleVideos")
        return prompts, {key: torch.cat([part[key] for part in parts]) for key in parts[0]}

    def on_fit_start(self, trainer, pl_module) -> None:
        if getattr(pl_module, "reads_first_frames", False):
            self.prompts, self.first = self.validation_rows(trainer.datamodule, pl_module)
            source = f"with their first frames, of the data's validation split ({type(trainer.datamodule).__name__})"
        else:
            self.prompts, source = self.resolve_prompts(trainer.datamodule)
        self._check_settings(pl_module)
        shown = ", ".join(repr(p if len(p) <= 60 else p[:57] + "...") for p in self.prompts)
        lighter = "".join(f", {name}={value}" for name, value in (("num_steps", self.num_steps),
                                                                   ("frames", self.frames)) if value is not None)
        rank_zero_info(f"SampleVideos: every {self.every} iterations{lighter}, {len(self.prompts)} prompts {source}: "
                       f"{shown}")

    def _check_settings(self, pl_module) -> None:
        problems = []
        sampler = getattr(pl_module, "sampler", None)
        if self.num_steps is not None and getattr(sampler, "step_sigmas", None) is not None:
            problems.append(f"num_steps={self.num_steps}, but the method samples a few-step list "
                            f"step_sigmas={sampler.step_sigmas}: drop num_steps")
        if self.frames is not None:
            try:
                with self.sampling(pl_module):
                    pl_module.check_sizes()
            except ValueError as err:
                problems.append(f"frames={self.frames}: {err}")
        if problems:
            raise ValueError("SampleVideos: " + "; ".join(problems))

    @contextlib.contextmanager
    def sampling(self, pl_module):
        """The method with this callback's ``num_steps`` and ``frames`` in place of its own, restored after."""
        sampler, run = getattr(pl_module, "sampler", None), getattr(pl_module, "run", None)
        try:
            if self.num_steps is not None and sampler is not None:
                pl_module.sampler = copy.copy(sampler)  # the scheduler is copied per call by the sampler itself
                pl_module.sampler.num_steps = self.num_steps
            if self.frames is not None and run is not None:
                pl_module.run = dataclasses.replace(run, frames=self.frames)
            yield
        finally:
            if sampler is not None:
                pl_module.sampler = sampler
            if run is not None:
                pl_module.run = run

    # ------------------------------------------------------------------ when
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        iteration = trainer.fit_loop.epoch_loop.batch_progress.total.processed
        if iteration % self.every == 0:
            self.log_samples(trainer, pl_module, iteration)

    def on_train_end(self, trainer, pl_module) -> None:
        iteration = trainer.fit_loop.epoch_loop.batch_progress.total.processed
        if iteration != self._last_sampled:  # not when just sampled (max_steps a multiple of the cadence)
            self.log_samples(trainer, pl_module, iteration)

    # ------------------------------------------------------------------ generate, gather, write
    def log_samples(self, trainer, pl_module, iteration: int) -> None:
        # every rank resolves the log folder (Lightning broadcasts it) and generates its share (one sequence-parallel
        # group: all of them); rank 0 gathers, writes and logs
        root = os.path.join(trainer.log_dir or trainer.default_root_dir, "samples")
        parts, part = data_parallel(trainer)
        indices, real = prompt_shares(len(self.prompts), parts)[part]
        share = [self.prompts[i] for i in indices]
        was_training = pl_module.training
        pl_module.eval()
        with self.sampling(pl_module):
            first = {key: value[indices].to(pl_module.device) for key, value in self.first.items()}
            videos = pl_module.generate(share, seed=self.seed + indices[0], **first)
        pl_module.train(was_training)
        captions = list(share)
        extra = getattr(pl_module, "sample_captions", None)  # e.g. joint_rl's refined prompts
        if callable(extra):
            captions = extra(share)
        self._last_sampled = iteration
        self._check_frames(videos)
        if parts > 1 and dist.is_available() and dist.is_initialized():
            gathered = gather_to_zero(videos, captions[:real], part)
            if gathered is None:
                return
            videos, captions = gathered
        else:
            videos, captions = videos[:real].cpu(), captions[:real]
        if trainer.is_global_zero:
            self._write_and_log(trainer, videos, captions, iteration, root)

    def _check_frames(self, videos: torch.Tensor) -> None:
        if self.frames is not None and videos.shape[2] != self.frames and not self._warned:
            self._warned = True
            rank_zero_warn(f"SampleVideos: frames={self.frames}, but the method's generate made {videos.shape[2]}-"
                           f"frame samples (it keeps its own size, e.g. a workflow's stages): drop frames")

    def _write_and_log(self, trainer, videos, captions, iteration: int, root: str) -> None:
        if self.write_files:
            for i, (video, text) in enumerate(zip(videos, captions)):
                write_media(os.path.join(root, f"it{iteration:06d}_{i}_{slug(text)}.gif"), video, self.fps)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                import wandb

                logger.experiment.log({
                    "samples/video": [wandb.Video(gif_bytes(v, self.fps), format="gif", caption=c)
                                      for v, c in zip(videos, captions)],
                    "trainer/global_step": trainer.global_step,
                })


def data_parallel(trainer) -> tuple[int, int]:
    """(data-parallel ranks, this process's): the strategy's sampler ranks (a sequence-parallel group is one), 1 and 0
    for a single device."""
    ranks = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(ranks.get("num_replicas") or 1), int(ranks.get("rank") or 0)


def gather_to_zero(videos: torch.Tensor, captions: list[str], part: int
                   ) -> Optional[tuple[torch.Tensor, list[str]]]:
    """Every rank's (n, 3, F, H, W) videos in [-1, 1] (the same n everywhere) and the captions of its real ones, on
    rank 0: the real videos of each data-parallel part once, in part order, as (N, 3, F, H, W) in [-1, 1] on the CPU
    with their captions; None on the other ranks. Sent as 8-bit frames, exactly what is written."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    frames = ((videos.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).to(device)  # as media.to_frames
    received = [torch.empty_like(frames) for _ in range(world)] if rank == 0 else None
    dist.gather(frames, received, dst=0)
    labels: Optional[list] = [None] * world if rank == 0 else None
    dist.gather_object((part, captions), labels, dst=0)
    if rank != 0:
        return None
    first: dict[int, int] = {}  # part -> the first rank that generated it (the others of its sequence group repeat it)
    for r, (p, _) in enumerate(labels):
        first.setdefault(p, r)
    ranks = [first[p] for p in sorted(first)]
    videos = torch.cat([received[r][: len(labels[r][1])] for r in ranks]).cpu().float() / 127.5 - 1
    return videos, [c for r in ranks for c in labels[r][1]]
