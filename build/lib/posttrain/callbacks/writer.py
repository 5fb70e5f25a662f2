"""``predict`` output: one .mp4 (or .gif / first-frame .png) per prompt."""
from __future__ import annotations

import os
from typing import Literal

from lightning.pytorch.callbacks import BasePredictionWriter

from posttrain.modules.media import slug, write_media


class MediaWriter(BasePredictionWriter):
    def __init__(self, output_dir: str = "outputs", format: Literal["mp4", "gif", "png"] = "mp4", fps: int = 8):
        super().__init__(write_interval="batch")
        self.output_dir, self.format, self.fps = output_dir, format, fps
        self.written: list[str] = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        for i, (prompt, video) in enumerate(zip(prediction["prompts"], prediction["videos"])):
            name = f"{batch_idx:04d}_{i:02d}_{trainer.global_rank}_{slug(prompt)}.{self.format}"
            self.written.append(write_media(os.path.join(self.output_dir, name), video, self.fps))
