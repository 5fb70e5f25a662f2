"""The synthetic world of the embedded default: its vocabulary, its captions and its renderer.

A video shows one shape (circle, square or triangle) of one palette colour moving in one direction
over a background of another colour; its caption names the four facts,
``"a red circle moving left on a blue background"``. Coordinates are fractions of the frame and the
shape wraps around the edges. The data module (``datamodules/synthetic.py``) draws the facts, the
metric (``modules/world/geneval.py``) reads them back from pixels; both use this file.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Optional

import torch

PALETTE: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.1, 0.1), "green": (0.1, 0.8, 0.2), "blue": (0.15, 0.25, 1.0),
    "yellow": (1.0, 0.9, 0.1), "magenta": (0.9, 0.1, 0.9), "cyan": (0.1, 0.9, 0.9),
}
SHAPES = ("circle", "square", "triangle")
MOTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
RADIUS = 0.22  # the shape's size, a fraction of the frame
SPEED = 0.25  # how far the shape moves over the whole clip, a fraction of the frame
# The shipped world's pace: SPEED over its 5-frame clips (4 frame steps). A longer clip at this pace
# (``ShapesDataset(speed=PACE)``) shows the same motion continuing, 4× the path at 17 frames.
PACE = SPEED / 4

# Area of each shape in units of radius² (see ``shape_mask``), and how far its centroid lies below the
# centre (triangle: apex at -r, base at 0.8r, so the centroid is 2/3 of 1.8r below the apex = +0.2r).
SHAPE_AREA = {"circle": torch.pi, "square": (2 * 0.85) ** 2, "triangle": 0.5 * 1.8 * (2 * 0.6 * 1.8)}
SHAPE_CENTROID_DY = {"circle": 0.0, "square": 0.0, "triangle": 0.2}


@dataclass(frozen=True)
class Facts:
    """The four facts of a synthetic video (None: the caption does not say)."""

    shape: Optional[str] = None
    colour: Optional[str] = None
    background: Optional[str] = None
    motion: Optional[str] = None


FACTS = tuple(f.name for f in fields(Facts))  # ("shape", "colour", "background", "motion")


def caption(shape: str, colour: str, motion: str, background: str) -> str:
    return f"a {colour} {shape} moving {motion} on a {background} background"


def parse_caption(text: str) -> Facts:
    """The facts a caption names. Reads the template's word order but tolerates extra words
    (a refined prompt): the shape is the first shape word, the colour the colour word right before it
    (else the first colour not followed by "background"), the background the colour followed by
    "background", the motion the first direction after "moving" (else the first direction word)."""
    words = re.findall(r"[a-z]+", text.lower())
    shape_at = next((i for i, w in enumerate(words) if w in SHAPES), None)
    background = next((w for i, w in enumerate(words[:-1]) if w in PALETTE and words[i + 1] == "background"), None)
    colour = None
    if shape_at is not None and shape_at > 0 and words[shape_at - 1] in PALETTE:
        colour = words[shape_at - 1]
    else:
        colour = next((w for i, w in enumerate(words) if w in PALETTE
                       and not (i + 1 < len(words) and words[i + 1] == "background")), None)
    moving_at = next((i for i, w in enumerate(words) if w == "moving"), -1)
    motion = next((w for w in words[moving_at + 1:] if w in MOTIONS), None)
    if motion is None:
        motion = next((w for w in words if w in MOTIONS), None)
    return Facts(shape=words[shape_at] if shape_at is not None else None, colour=colour,
                 background=background, motion=motion)


def wrap(d: torch.Tensor) -> torch.Tensor:
    """A difference of frame fractions wrapped into [-0.5, 0.5) (the world is a torus)."""
    return torch.remainder(d + 0.5, 1.0) - 0.5


def grid(height: int, width: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(H, W) pixel-centre coordinates y, x as fractions of the frame."""
    ys = (torch.arange(height, dtype=torch.float32, device=device) + 0.5) / height
    xs = (torch.arange(width, dtype=torch.float32, device=device) + 0.5) / width
    return torch.meshgrid(ys, xs, indexing="ij")


def shape_mask(shape: str, cx: torch.Tensor, cy: torch.Tensor, height: int, width: int,
               radius: float | torch.Tensor = RADIUS) -> torch.Tensor:
    """(..., H, W) bool mask of ``shape`` centred at (cx, cy) (tensors of any batch shape ``...``),
    on the torus: a shape that leaves one edge re-enters at the other."""
    yy, xx = grid(height, width, device=torch.as_tensor(cx).device)
    cx, cy = torch.as_tensor(cx, dtype=torch.float32), torch.as_tensor(cy, dtype=torch.float32)
    r = torch.as_tensor(radius, dtype=torch.float32)[..., None, None]
    ddx, ddy = wrap(xx - cx[..., None, None]), wrap(yy - cy[..., None, None])
    if shape == "circle":
        return ddx**2 + ddy**2 <= r**2
    if shape == "square":
        return (ddx.abs() <= r * 0.85) & (ddy.abs() <= r * 0.85)
    if shape == "triangle":  # pointing up
        return (ddy <= r * 0.8) & (ddy >= -r) & (ddx.abs() <= (ddy + r) * 0.6)
    raise ValueError(f"unknown shape {shape!r}; choose one of {SHAPES}")


def render(shape: str, colour: str, motion: str, background: str, frames: int, height: int, width: int,
           start: tuple[float, float] = (0.5, 0.5), radius: float = RADIUS, speed: float = SPEED) -> torch.Tensor:
    """(3, F, H, W) video in [-1, 1]: the shape moves ``speed`` of the frame from ``start`` over the clip."""
    dx, dy = MOTIONS[motion]
    t = torch.arange(frames, dtype=torch.float32) / max(frames - 1, 1)
    mask = shape_mask(shape, start[0] + dx * speed * t, start[1] + dy * speed * t, height, width, radius)  # (F, H, W)
    fg = torch.tensor(PALETTE[colour]).view(3, 1, 1, 1)
    bg = torch.tensor(PALETTE[background]).view(3, 1, 1, 1)
    return torch.where(mask[None], fg, bg) * 2 - 1
