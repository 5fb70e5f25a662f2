"""Sample videos every N iterations, through the same sampler as ``predict`` and every rollout."""
from __future__ import annotations

import os
from typing import Optional

from lightning.pytorch import Callback
from lightning.pytorch.loggers import WandbLogger

from posttrain.modules.io.media import gif_bytes, slug, write_media

DEFAULT_PROMPTS = ("a red circle moving left on a blue background",
                   "a yellow square moving down on a magenta background")


class SampleVideos(Callback):
    """Generate ``prompts`` every ``every_n_iterations`` (and at the end), log them to W&B as GIFs
    with the prompt as caption, and write them under ``<log_dir>/samples`` when ``write_files``."""

    def __init__(self, every_n_iterations: int = 100, prompts: Optional[list[str]] = None, seed: int = 0,
                 fps: int = 8, write_files: bool = True):
        if every_n_iterations < 1:
            raise ValueError(f"every_n_iterations={every_n_iterations} must be >= 1")
        self.every = every_n_iterations
        self.prompts = list(prompts or DEFAULT_PROMPTS)
        self.seed, self.fps, self.write_files = seed, fps, write_files

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        iteration = trainer.fit_loop.epoch_loop.batch_progress.total.processed
        if iteration % self.every == 0:
            self.log_samples(trainer, pl_module, iteration)

    def on_train_end(self, trainer, pl_module) -> None:
        self.log_samples(trainer, pl_module, trainer.fit_loop.epoch_loop.batch_progress.total.processed)

    def log_samples(self, trainer, pl_module, iteration: int) -> None:
        # every rank generates (a ZeRO-3 expert gathers its weights collectively) and resolves the log
        # folder (Lightning broadcasts it); rank 0 alone writes and logs
        root = os.path.join(trainer.log_dir or trainer.default_root_dir, "samples")
        was_training = pl_module.training
        pl_module.eval()
        videos = pl_module.generate(self.prompts, seed=self.seed).cpu()
        pl_module.train(was_training)
        captions = list(self.prompts)
        extra = getattr(pl_module, "sample_captions", None)  # e.g. joint_rl's refined prompts
        if callable(extra):
            captions = extra(self.prompts)
        if trainer.is_global_zero:
            self._write_and_log(trainer, videos, captions, iteration, root)

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
