"""``predict`` output: one .mp4 (or .gif / first-frame .png) per prompt; a workflow's stages each in their folder."""
from __future__ import annotations

import os
from typing import Literal

from lightning.pytorch.callbacks import BasePredictionWriter

from posttrain.modules.io.media import slug, write_media


class MediaWriter(BasePredictionWriter):
    """Write every predicted sample. A one-frame output is an image and is written as .png; longer ones in
    ``format``. A workflow's prediction carries every stage's output (``"stages"``): each generator stage's
    media go to ``<output_dir>/<stage>/``, each refiner stage's prompts to ``<output_dir>/<stage>/<name>.txt``,
    under the same file name, so an image and the video made from it sit side by side."""

    def __init__(self, output_dir: str = "outputs", format: Literal["mp4", "gif", "png"] = "mp4", fps: int = 8):
        super().__init__(write_interval="batch")
        self.output_dir, self.format, self.fps = output_dir, format, fps
        self.written: list[str] = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        stages = prediction.get("stages")
        for i, prompt in enumerate(prediction["prompts"]):
            name = f"{batch_idx:04d}_{i:02d}_{trainer.global_rank}_{slug(prompt)}"
            if stages is None:
                self._write(os.path.join(self.output_dir, name), prediction["videos"][i])
                continue
            for stage, output in stages.items():
                path = os.path.join(self.output_dir, stage, name)
                if isinstance(output, list):  # a refiner stage: the prompt it passed on
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    with open(path + ".txt", "w", encoding="utf-8") as f:
                        f.write(output[i] + "\n")
                    self.written.append(path + ".txt")
                else:
                    self._write(path, output[i])

    def _write(self, stem: str, media) -> None:
        ext = "png" if media.shape[1] == 1 else self.format
        self.written.append(write_media(f"{stem}.{ext}", media, self.fps))
