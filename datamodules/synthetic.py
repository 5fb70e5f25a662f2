"""The embedded default data: seeded videos of a coloured shape moving over a coloured background.

Every sample is a pure function of ``(seed, index)``: a shape (circle, square or triangle) of one
colour moves in one direction over a background of another, and the caption names all four facts,
e.g. ``"a red circle moving left on a blue background"``. A tiny text-conditioned generator can learn
it (colours are global statistics, motion a smooth shift), and the colour-alignment reward of the RL
methods reads the same colour names from the prompts.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.utils.data import DataLoader, Dataset

from posttrain.datamodules.sampling import ResumableDataModule

COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.1, 0.1), "green": (0.1, 0.8, 0.2), "blue": (0.15, 0.25, 1.0),
    "yellow": (1.0, 0.9, 0.1), "magenta": (0.9, 0.1, 0.9), "cyan": (0.1, 0.9, 0.9),
}
SHAPES = ("circle", "square", "triangle")
MOTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}


def caption(shape: str, colour: str, motion: str, background: str) -> str:
    return f"a {colour} {shape} moving {motion} on a {background} background"


def render(shape: str, colour: str, motion: str, background: str, frames: int, height: int, width: int,
           start: tuple[float, float] = (0.5, 0.5), radius: float = 0.22, speed: float = 0.25) -> torch.Tensor:
    """(3, F, H, W) video in [-1, 1]. Positions are fractions of the frame; the shape wraps around."""
    ys = (torch.arange(height, dtype=torch.float32) + 0.5) / height
    xs = (torch.arange(width, dtype=torch.float32) + 0.5) / width
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    fg = torch.tensor(COLOURS[colour]).view(3, 1, 1)
    bg = torch.tensor(COLOURS[background]).view(3, 1, 1)
    dx, dy = MOTIONS[motion]
    video = []
    for f in range(frames):
        t = f / max(frames - 1, 1)
        cx, cy = (start[0] + dx * speed * t) % 1.0, (start[1] + dy * speed * t) % 1.0
        ddx, ddy = xx - cx, yy - cy
        if shape == "circle":
            mask = ddx**2 + ddy**2 <= radius**2
        elif shape == "square":
            mask = (ddx.abs() <= radius * 0.85) & (ddy.abs() <= radius * 0.85)
        else:  # triangle pointing up
            mask = (ddy <= radius * 0.8) & (ddy >= -radius) & (ddx.abs() <= (ddy + radius) * 0.6)
        video.append(torch.where(mask, fg, bg))
    return torch.stack(video, dim=1) * 2 - 1


class ShapesDataset(Dataset):
    """``num_samples`` seeded (video, prompt) pairs; ``index`` picks the facts, ``seed`` the layout."""

    def __init__(self, num_samples: int, frames: int, height: int, width: int, seed: int = 0):
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples} must be >= 1")
        self.num_samples, self.frames, self.height, self.width, self.seed = num_samples, frames, height, width, seed

    def __len__(self) -> int:
        return self.num_samples

    def facts(self, index: int) -> tuple[str, str, str, str]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        colours = list(COLOURS)
        colour = colours[int(torch.randint(len(colours), (1,), generator=g))]
        background = [c for c in colours if c != colour][int(torch.randint(len(colours) - 1, (1,), generator=g))]
        shape = SHAPES[int(torch.randint(len(SHAPES), (1,), generator=g))]
        motion = list(MOTIONS)[int(torch.randint(len(MOTIONS), (1,), generator=g))]
        return shape, colour, motion, background

    def __getitem__(self, index: int) -> dict:
        shape, colour, motion, background = self.facts(index)
        g = torch.Generator().manual_seed(self.seed * 7_919 + index)
        start = tuple(float(v) for v in 0.25 + 0.5 * torch.rand(2, generator=g))
        video = render(shape, colour, motion, background, self.frames, self.height, self.width, start=start)
        return {"video": video, "prompt": caption(shape, colour, motion, background), "index": index}


class SyntheticVideos(ResumableDataModule):
    """Captioned shape videos, generated on the fly (the embedded default for finetune and predict).

    Args:
        num_samples: training set size; validation uses ``val_samples`` more indices after them.
        frames, height, width: video size in pixels (Wan VAE: frames = 4k+1, H and W multiples of 8).
        batch_size, num_workers, seed: loader settings; ``seed`` fixes content and order.
    """

    def __init__(self, num_samples: int = 512, val_samples: int = 8, frames: int = 9, height: int = 32,
                 width: int = 32, batch_size: int = 4, num_workers: int = 0, seed: int = 0):
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        self.num_samples, self.val_samples = num_samples, val_samples
        self.frames, self.height, self.width = frames, height, width

    def train_dataset(self) -> Dataset:
        return ShapesDataset(self.num_samples, self.frames, self.height, self.width, self.seed)

    def val_dataloader(self) -> Optional[DataLoader]:
        dataset = ShapesDataset(self.num_samples + self.val_samples, self.frames, self.height, self.width, self.seed)
        subset = torch.utils.data.Subset(dataset, range(self.num_samples, self.num_samples + self.val_samples))
        return DataLoader(subset, batch_size=self.batch_size, num_workers=self.num_workers)

    def predict_dataloader(self) -> DataLoader:
        dataset = ShapesDataset(self.val_samples, self.frames, self.height, self.width, self.seed + 1)
        # the first frame rides along: an image-to-video generator animates it (the others ignore it)
        prompts = [{"prompt": dataset[i]["prompt"], "seed": i, "image": dataset[i]["video"][:, 0]}
                   for i in range(len(dataset))]
        return DataLoader(prompts, batch_size=self.batch_size)
