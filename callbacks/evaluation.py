"""Evaluate the serving generator at every validation: synthetic GenEval (and a Fréchet VAE distance) of
samples of fixed prompts from fixed seeds, logged as ``val/<name>/<metric>`` and a W&B table.

Runs in ``on_validation_epoch_end``, so at every ``val_check_interval`` of ``fit`` and in ``validate``
(not in the sanity check). The prompts are ``num_prompts`` synthetic captions (``ShapesDataset`` with this
callback's ``seed``, ``include``/``exclude``); every process samples its share, and the torchmetrics
metrics reduce over all processes, so the figures are the mean over every sample (not rank 0's).
Two instances with different ``name`` and concepts score, e.g., the seen and the held-out concepts.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.loggers import WandbLogger

from posttrain.datamodules.synthetic import ShapesDataset
from posttrain.modules.eval.frechet import VideoFrechetDistance
from posttrain.modules.world.geneval import SyntheticGenEval, read_facts
from posttrain.modules.io.media import gif_bytes
from posttrain.modules.world.world import caption

METRICS = ("geneval", "frechet", "clip_score")


def still_caption(prompt: str) -> str:
    """A synthetic caption without its motion phrase (what a 1-frame generator is asked)."""
    words = prompt.split(" ")
    if "moving" in words:
        at = words.index("moving")
        words = words[:at] + words[at + 2:]
    return " ".join(words)


class Evaluate(Callback):
    """Score the serving generator on fixed prompts at every validation.

    Args:
        name: the metric group: logs ``val/<name>/shape|colour|background|motion|all`` (synthetic GenEval
            accuracies) and ``val/<name>/frechet``.
        metrics: any of ``"geneval"``, ``"frechet"`` (the Fréchet distance, on frames, between the samples
            and the rendered videos of the same captions, through torchmetrics' FID with the shipped VAE's
            encoder as the feature network: a Fréchet *VAE* distance, not Inception FID) and ``"clip_score"``
            (torchmetrics' CLIPScore of up to 4 evenly spaced frames and the prompt, from ``clip``).
        num_prompts: how many synthetic captions; they and their noise seeds are the same at every validation.
        include, exclude: concepts every caption must / must not show (``"magenta"``, ``"shape:circle"``).
        seed: picks the captions (``ShapesDataset`` seed) and the first noise seed.
        batch_size: prompts per ``generate`` call.
        table: log a W&B table (prompt, sample, facts read back, verdict) at each evaluation.
        clip: a local transformers CLIP folder (model and processor), for ``clip_score``.
    """

    def __init__(self, name: str = "geneval", metrics: Sequence[str] = ("geneval",), num_prompts: int = 16,
                 include: Sequence[str] = (), exclude: Sequence[str] = (), seed: int = 1000, batch_size: int = 8,
                 table: bool = True, clip: Optional[str] = None):
        unknown = sorted(set(metrics) - set(METRICS))
        if unknown or not metrics:
            raise ValueError(f"Evaluate: metrics={list(metrics)}; choose from {list(METRICS)}")
        if num_prompts < 1 or batch_size < 1:
            raise ValueError(f"Evaluate: num_prompts={num_prompts} and batch_size={batch_size} must be >= 1")
        self.name, self.metrics, self.num_prompts = name, tuple(metrics), num_prompts
        self.include, self.exclude, self.seed = list(include), list(exclude), seed
        self.batch_size, self.table = batch_size, table
        ShapesDataset(1, 1, 8, 8, exclude=self.exclude, include=self.include)  # bad concepts fail at start-up
        self._frechet: Optional[VideoFrechetDistance] = None
        self._fixed: dict[tuple[int, int, int], tuple[list[str], Optional[torch.Tensor]]] = {}
        self._clip = None
        if "clip_score" in self.metrics:
            if clip is None:
                raise ValueError("Evaluate: metric clip_score needs `clip:`, a local transformers CLIP folder")
            from posttrain.modules.rewards.clip import clip_score_metric

            self._clip = clip_score_metric(clip)  # a folder that cannot serve stops here, before training

    def setup(self, trainer, pl_module, stage: str) -> None:
        names = [c.name for c in trainer.callbacks if isinstance(c, Evaluate)]
        if names.count(self.name) > 1:
            raise ValueError(f"two Evaluate callbacks are named {self.name!r} (both would log val/{self.name}/...); "
                             f"give each its own `name`")

    def drawn_prompts(self, datamodule, video) -> list[str]:
        """The captions it samples at the run's ``video`` size: what a run that does not load its text encoder needs
        rows of (``posttrain preprocess`` encodes them, ``callbacks.precomputed`` caches them)."""
        return self.prompts_and_videos(video.frames, video.height, video.width)[0]

    def prompts_and_videos(self, frames: int, height: int, width: int) -> tuple[list[str], Optional[torch.Tensor]]:
        """The fixed captions (motion dropped for a 1-frame generator) and, for ``frechet``, their rendered
        videos; made once per size (they are the same at every validation)."""
        key = (frames, height, width)
        if key not in self._fixed:
            data = ShapesDataset(self.num_prompts, frames, height, width, seed=self.seed, exclude=self.exclude,
                                 include=self.include)
            prompts = [caption(*data.facts(i)) for i in range(len(data))]
            prompts = prompts if frames > 1 else [still_caption(p) for p in prompts]
            real = torch.stack([data[i]["video"] for i in range(len(data))]) if "frechet" in self.metrics else None
            self._fixed[key] = (prompts, real)
        return self._fixed[key]

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        size = pl_module.video
        prompts, real = self.prompts_and_videos(size.frames, size.height, size.width)
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() \
            else (0, 1)
        geneval = SyntheticGenEval().to(pl_module.device)
        if "frechet" in self.metrics and self._frechet is None:
            self._frechet = VideoFrechetDistance(reset_real_features=True)
        frechet = self._frechet.to(pl_module.device) if "frechet" in self.metrics else None
        if frechet is not None:
            frechet.reset()
        clip = self._clip.to(pl_module.device) if self._clip is not None else None
        if clip is not None:
            clip.reset()

        # every process samples batches rank, rank + world, ... (a ZeRO-3 expert gathers its weights
        # collectively, so every rank runs the same number of generate calls)
        starts = list(range(0, len(prompts), self.batch_size))
        rows = []
        was_training = pl_module.training
        pl_module.eval()
        for k in range(rank, len(starts) + (-len(starts)) % world, world):
            start = starts[min(k, len(starts) - 1)]
            batch = prompts[start:start + self.batch_size]
            videos = pl_module.generate(batch, seed=self.seed + start).float()
            if k >= len(starts):  # a padding call that keeps the collectives in step; not scored
                continue
            geneval.update(videos, batch)
            if frechet is not None:
                frechet.update(real[start:start + self.batch_size].to(videos), real=True)
                frechet.update(videos.clamp(-1, 1), real=False)
            if clip is not None:
                from posttrain.modules.rewards.clip import to_uint8

                picks = torch.linspace(0, videos.shape[2] - 1, min(4, videos.shape[2])).round().long().tolist()
                for f in picks:
                    clip.update(list(to_uint8(videos[:, :, f])), batch)  # on the device the model runs on
            if self.table:
                rows += [(p, v.cpu(), read_facts(v)) for p, v in zip(batch, videos)]
        pl_module.train(was_training)

        scores = {k: v for k, v in geneval.compute().items() if not torch.isnan(v)} \
            if "geneval" in self.metrics else {}
        if frechet is not None:
            scores["frechet"] = frechet.compute()
        if clip is not None:
            scores["clip_score"] = clip.compute()
        for key, value in scores.items():
            pl_module.log(f"val/{self.name}/{key}", value.float().to(pl_module.device), sync_dist=False,
                          rank_zero_only=True, batch_size=len(prompts))
        if self.table and trainer.is_global_zero:
            self._log_table(trainer, rows)

    def _log_table(self, trainer, rows) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                import wandb

                columns = ["prompt", "sample", "shape", "colour", "background", "motion"]
                data = [[p, wandb.Video(gif_bytes(v), format="gif"), f.shape, f.colour, f.background, f.motion]
                        for p, v, f in rows]
                logger.experiment.log({f"val/{self.name}/table": wandb.Table(columns=columns, data=data),
                                       "trainer/global_step": trainer.global_step})
