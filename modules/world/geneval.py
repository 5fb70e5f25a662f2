"""Synthetic GenEval: the four facts of a synthetic caption read back from pixels, no learned model.

GenEval (Ghosh et al. 2023) asks an object detector whether an image shows what its prompt names.
In the synthetic world (``modules/world/world.py``) image analysis answers exactly, so the score of a
generator is the share of prompts whose facts its videos show (docs/methods.md#synthetic-geneval):

- background: the most common nearest-palette colour of the border pixels (all frames);
- shape colour: the most common nearest-palette colour among the other pixels;
- shape mask: pixels nearer the shape colour than the background colour (robust to blurred edges);
- one colour: a shape of which, in some frame, more than a third of the mask is *foreign* (farther from every
  blend of the shape and background colours than half the palette's closest pair: a red core in a yellow
  square, a cyan band in a blue one) shows no single colour, so its colour is not shown (the mask alone would
  take the core as part of a yellow square);
- motion: the mask's centroid path (circular means on the torus, summed frame-to-frame steps); its
  larger axis and sign give left/right/up/down, a path under ``min_motion`` of the frame is no motion;
- shape kind: per frame, the IoU of the mask with a circle, square and triangle template of the same
  area at the same centroid; the best mean IoU over frames wins (the fill ratio of the bounding box
  breaks on a shape that wraps around the edge and on soft masks).

Validated in ``tests/test_geneval.py``: >= 0.95 per fact on rendered videos and on the shipped VAE's
reconstructions, near chance on shuffled prompts.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torchmetrics import Metric

from posttrain.modules.world.world import (
    FACTS, MOTIONS, PALETTE, SHAPE_AREA, SHAPE_CENTROID_DY, SHAPES, Facts, parse_caption, shape_mask, wrap,
)

_COLOUR_NAMES = tuple(PALETTE)
MAX_FOREIGN = 1 / 3  # the most of a frame's shape mask that may be neither its colour nor a blend with the background


def _palette(device) -> torch.Tensor:
    """(P, 3) palette RGB in [-1, 1]."""
    return torch.tensor([PALETTE[c] for c in _COLOUR_NAMES], device=device) * 2 - 1


def _foreign_share(pixels: torch.Tensor, mask: torch.Tensor, fg: torch.Tensor, bg: torch.Tensor,
                   palette: torch.Tensor) -> torch.Tensor:
    """Per frame, the share of the mask's pixels farther from the segment fg–bg in RGB (every blend of the shape
    and background colours: a blurred edge) than half the palette's closest pair of colours. (F,)"""
    gaps = torch.cdist(palette, palette)
    tolerance = gaps[gaps > 0].min() / 2
    t = ((pixels - fg) * (bg - fg)).sum(-1, keepdim=True).div((bg - fg).pow(2).sum()).clamp(0, 1)
    foreign = ((pixels - fg - t * (bg - fg)).norm(dim=-1) > tolerance) & (mask > 0)
    return foreign.sum((1, 2)) / mask.sum((1, 2)).clamp(min=1)


def _circular_mean(weights: torch.Tensor, coords: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Mean position on the unit circle of ``coords`` (fractions) weighted by ``weights``, in [0, 1)."""
    angle = 2 * torch.pi * coords
    s = (weights * torch.sin(angle)).sum(dims)
    c = (weights * torch.cos(angle)).sum(dims)
    return torch.remainder(torch.atan2(s, c) / (2 * torch.pi), 1.0)


@torch.no_grad()
def read_facts(video: torch.Tensor, min_motion: float = 0.05) -> Facts:
    """The facts one (3, F, H, W) video in [-1, 1] shows (None where it shows none, e.g. no shape)."""
    if video.ndim != 4 or video.shape[0] != 3:
        raise ValueError(f"read_facts takes one (3, F, H, W) video in [-1, 1]; got shape {tuple(video.shape)}")
    video = video.float()
    _, frames, height, width = video.shape
    palette = _palette(video.device)
    pixels = video.permute(1, 2, 3, 0)  # (F, H, W, 3)
    nearest = torch.cdist(pixels.reshape(-1, 3), palette).argmin(-1).view(frames, height, width)

    # 1. background: the mode of the border pixels' nearest palette colour
    border = torch.cat([nearest[:, 0], nearest[:, -1], nearest[:, :, 0], nearest[:, :, -1]], dim=-1)
    bg = int(torch.mode(border.flatten()).values)
    # 2. shape colour: the mode of the other pixels' nearest palette colour
    other = nearest[nearest != bg]
    if other.numel() == 0:
        return Facts(background=_COLOUR_NAMES[bg])
    fg = int(torch.mode(other).values)
    # 3. mask: nearer the shape colour than the background colour
    mask = ((pixels - palette[fg]).pow(2).sum(-1) < (pixels - palette[bg]).pow(2).sum(-1)).float()  # (F, H, W)
    area = mask.sum((1, 2))  # (F,)
    mixed = bool((_foreign_share(pixels, mask, palette[fg], palette[bg], palette) > MAX_FOREIGN).any())
    facts = Facts(colour=None if mixed else _COLOUR_NAMES[fg], background=_COLOUR_NAMES[bg])
    if bool((area == 0).any()):
        return facts
    yy = ((torch.arange(height, device=video.device) + 0.5) / height).view(1, height, 1)
    xx = ((torch.arange(width, device=video.device) + 0.5) / width).view(1, 1, width)
    cx = _circular_mean(mask, xx.expand_as(mask), (1, 2))  # (F,)
    cy = _circular_mean(mask, yy.expand_as(mask), (1, 2))
    # 4. motion: the summed frame-to-frame centroid steps (each wrapped to the short way round)
    path_x, path_y = float(wrap(cx.diff()).sum()), float(wrap(cy.diff()).sum())
    motion = None
    if max(abs(path_x), abs(path_y)) >= min_motion:
        step = (int(path_x > 0) * 2 - 1, 0) if abs(path_x) >= abs(path_y) else (0, int(path_y > 0) * 2 - 1)
        motion = next(name for name, d in MOTIONS.items() if d == step)
    # 5. shape kind: IoU with same-area templates centred on the mask's centroid, best mean over frames
    area_frac = area / (height * width)
    ious = []
    for kind in SHAPES:
        radius = (area_frac / SHAPE_AREA[kind]).sqrt()
        template = shape_mask(kind, cx, cy - SHAPE_CENTROID_DY[kind] * radius, height, width, radius).float()
        inter = (template * mask).sum((1, 2))
        union = (template + mask).clamp(max=1).sum((1, 2))
        ious.append((inter / union).mean())
    shape = SHAPES[int(torch.stack(ious).argmax())]
    return Facts(shape=shape, colour=facts.colour, background=facts.background, motion=motion)


def judge(videos: torch.Tensor, prompts: Sequence[str], min_motion: float = 0.05) -> dict[str, torch.Tensor]:
    """Per-sample verdicts of (B, 3, F, H, W) videos against their prompts: ``{fact: (B,)}`` with 1.0
    (shown), 0.0 (not shown) or NaN (the prompt does not name that fact), for the four facts."""
    if videos.ndim != 5 or videos.shape[1] != 3:
        raise ValueError(f"synthetic GenEval takes (B, 3, F, H, W) videos in [-1, 1]; got shape {tuple(videos.shape)}")
    if len(prompts) != videos.shape[0]:
        raise ValueError(f"synthetic GenEval: {len(prompts)} prompts for {videos.shape[0]} videos")
    asked = []
    for prompt in prompts:
        asked.append(parse_caption(prompt))
        if all(getattr(asked[-1], f) is None for f in FACTS):
            raise ValueError(f"synthetic GenEval: prompt {prompt!r} names no shape, colour, background or motion "
                             f"of the synthetic world ({SHAPES}, {_COLOUR_NAMES}, {tuple(MOTIONS)}); score "
                             f"synthetic captions, or the original prompts of refined ones")
    return judge_facts(videos, asked, min_motion)


def judge_facts(videos: torch.Tensor, asked: Sequence[Facts], min_motion: float = 0.05) -> dict[str, torch.Tensor]:
    """Per-sample verdicts of (B, 3, F, H, W) videos against the facts asked of each (a user request's,
    ``modules/world/requests.py``): ``{fact: (B,)}``, 1.0 shown, 0.0 not, NaN where ``asked`` leaves the fact out."""
    if videos.ndim != 5 or videos.shape[1] != 3:
        raise ValueError(f"synthetic GenEval takes (B, 3, F, H, W) videos in [-1, 1]; got shape {tuple(videos.shape)}")
    if len(asked) != videos.shape[0]:
        raise ValueError(f"synthetic GenEval: {len(asked)} sets of facts for {videos.shape[0]} videos")
    verdicts = {fact: torch.full((len(asked),), float("nan")) for fact in FACTS}
    for b, facts in enumerate(asked):
        shown = read_facts(videos[b], min_motion)
        for fact in FACTS:
            if getattr(facts, fact) is not None:
                verdicts[fact][b] = float(getattr(shown, fact) == getattr(facts, fact))
    return {fact: v.to(videos.device) for fact, v in verdicts.items()}


def windows(videos: torch.Tensor) -> list[torch.Tensor]:
    """(B, 3, F, H, W) -> the (B, 3, 5, H, W) windows of pixel frames [4(p-1), 4p], p = 1 .. (F-1)/4: window p ends on
    latent frame p of a 4x temporal VAE (latent frame 0 is pixel frame 0, latent frame p pixel frames 4p-3 .. 4p), so
    it shows what latent frame (or chunk position) p holds, at the world's clip length, which GenEval reads."""
    return [videos[:, :, 4 * (p - 1):4 * p + 1] for p in range(1, (videos.shape[2] - 1) // 4 + 1)]


class SyntheticGenEval(Metric):
    """Accuracy of each fact and of all four together, over every video seen (by every process).

    ``update(videos (B, 3, F, H, W) in [-1, 1], prompts)``; ``compute()`` returns
    ``{"shape", "colour", "background", "motion", "all"}`` accuracies. A fact counts only over the
    prompts that name it, ``all`` over the prompts that name all four. States are sums, reduced across
    processes by torchmetrics (``dist_reduce_fx="sum"``).
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False
    KEYS = FACTS + ("all",)

    def __init__(self, min_motion: float = 0.05, **kwargs):
        super().__init__(**kwargs)
        self.min_motion = min_motion
        self.add_state("correct", torch.zeros(len(self.KEYS), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("asked", torch.zeros(len(self.KEYS), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, videos: torch.Tensor, prompts: Sequence[str]) -> None:
        verdicts = judge(videos, prompts, self.min_motion)
        table = torch.stack([verdicts[f] for f in FACTS], dim=1).double().cpu()  # (B, 4)
        all_asked = ~table.isnan().any(1)
        correct = torch.cat([table.nan_to_num(0.0).sum(0), (table[all_asked] == 1).all(1).sum().view(1)])
        asked = torch.cat([(~table.isnan()).sum(0), all_asked.sum().view(1)]).double()
        self.correct += correct.to(self.correct)
        self.asked += asked.to(self.asked)

    def compute(self) -> dict[str, torch.Tensor]:
        acc = self.correct / self.asked.clamp(min=1)
        acc = torch.where(self.asked > 0, acc, torch.full_like(acc, float("nan")))
        return {key: acc[i].float() for i, key in enumerate(self.KEYS)}


def chance(fact: str) -> float:
    """Accuracy of a uniformly random guess among the world's values (background and colour differ)."""
    return {"shape": 1 / len(SHAPES), "colour": 1 / len(PALETTE), "background": 1 / len(PALETTE),
            "motion": 1 / len(MOTIONS)}[fact]
