"""The rewards of the synthetic world: each reads colour, shape and motion back from pixels against the facts its
prompt names, so none needs a downloaded model (see ``posttrain.modules.world``)."""
from __future__ import annotations

import math
import re
from typing import Literal, Optional

import torch

from posttrain.modules.rewards.base import Reward, RewardOutput, prompts_for_scoring
from posttrain.modules.world.geneval import judge
from posttrain.modules.world.requests import all_asked_right, share_of_asked_right
from posttrain.modules.world.world import MOTIONS  # (dx, dy) of each direction, in frame fractions

# The palette of the synthetic shape videos (``posttrain.datamodules.synthetic.COLOURS``, RGB in [0, 1]). A copy,
# because modules/ must not import the datamodules (they import Lightning); a test keeps them equal.
PALETTE: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.1, 0.1), "green": (0.1, 0.8, 0.2), "blue": (0.15, 0.25, 1.0),
    "yellow": (1.0, 0.9, 0.1), "magenta": (0.9, 0.1, 0.9), "cyan": (0.1, 0.9, 0.9),
}



class ColourAlignment(Reward):
    """How close the video's mean colour is to the mix of colours its prompt names (the default).

    The prompt's palette words are read in order: the first is the shape's colour, a colour followed by
    "background" the background's (the synthetic captions: "a red circle moving left on a blue
    background"). The target is ``fg_fraction·fg + (1-fg_fraction)·bg`` (one named colour: that colour);
    the reward is ``1 - |mean RGB - target| / (2√3)`` in [0, 1], a smooth global statistic a tiny
    generator can move in a few dozen RL iterations. A prompt naming no palette colour scores
    ``no_colour_reward``. Terms: ``distance`` (the RGB distance, in [0, 2√3]).

    Args:
        fg_fraction: the shape's share of the frame (a circle of radius 0.22 covers about 0.15).
        palette: colour name -> RGB in [0, 1]; None = the synthetic palette.
        no_colour_reward: reward of a prompt that names no colour of the palette.
    """

    def __init__(self, fg_fraction: float = 0.15, palette: Optional[dict[str, tuple[float, float, float]]] = None,
                 no_colour_reward: float = 0.0):
        if not 0.0 <= fg_fraction <= 1.0:
            raise ValueError(f"ColourAlignment: fg_fraction={fg_fraction} must be in [0, 1]")
        self.fg_fraction = fg_fraction
        self.palette = dict(palette or PALETTE)
        self.no_colour_reward = no_colour_reward

    def target(self, prompt: str) -> Optional[torch.Tensor]:
        """(3,) target RGB in [-1, 1] of ``prompt``, or None when it names no palette colour."""
        words = re.findall(r"[a-z]+", prompt.lower())
        named = [(i, w) for i, w in enumerate(words) if w in self.palette]
        if not named:
            return None
        background = [w for i, w in named if i + 1 < len(words) and words[i + 1] == "background"]
        foreground = [w for _, w in named if w not in background]
        rgb = lambda w: torch.tensor(self.palette[w]) * 2 - 1  # noqa: E731  [0, 1] -> [-1, 1]
        if foreground and background:
            return self.fg_fraction * rgb(foreground[0]) + (1 - self.fg_fraction) * rgb(background[-1])
        return rgb((foreground or background)[0])

    def __call__(self, media, prompts, context=None) -> RewardOutput:
        prompts = prompts_for_scoring(prompts, context)
        mean_rgb = media.float().mean(dim=(2, 3, 4))  # (B, 3)
        total = torch.full((media.shape[0],), float(self.no_colour_reward), device=media.device)
        distance = torch.zeros(media.shape[0], device=media.device)
        for b, prompt in enumerate(prompts):
            target = self.target(prompt)
            if target is not None:
                distance[b] = (mean_rgb[b] - target.to(media.device)).norm()
                total[b] = 1 - distance[b] / (2 * math.sqrt(3))
        return RewardOutput(total, {"distance": distance})


class SyntheticGenEvalReward(Reward):
    """Synthetic GenEval as a reward, the way Flow-GRPO optimises GenEval: per sample, one term per fact
    of the synthetic world (``shape``, ``colour``, ``background``, ``motion``: 1 when the video shows what
    the prompt names, else 0, read back from pixels by ``modules/world/geneval.py``) and a total of either the
    mean of the facts the prompt names (``total="mean"``, a denser signal) or 1 only when all of them
    are shown (``"all"``, GenEval's strict score). A fact the prompt does not name scores 0 in its term
    and does not count in the total; a prompt naming none stops with an error. Scores the original
    prompt under joint RL.

    Args:
        total: how the facts combine into the total.
        min_motion: the shape's path, in frames, below which the video shows no motion.
    """

    def __init__(self, total: Literal["mean", "all"] = "mean", min_motion: float = 0.05):
        if total not in ("mean", "all"):
            raise ValueError(f"SyntheticGenEvalReward: total={total!r}; choose 'mean' or 'all'")
        self.total, self.min_motion = total, min_motion

    def verdicts(self, media, prompts, context=None) -> dict[str, torch.Tensor]:
        """``{fact: (B,)}``: 1 shown, 0 not, NaN not asked (``geneval.judge`` of the prompts scored)."""
        return judge(media.detach(), prompts_for_scoring(prompts, context), self.min_motion)

    def __call__(self, media, prompts, context=None) -> RewardOutput:
        return self.combine(self.verdicts(media, prompts, context))

    def combine(self, verdicts: dict[str, torch.Tensor]) -> RewardOutput:
        """The total (``mean`` of the facts asked, or ``all`` shown) and one term per fact (0 where not asked)."""
        table = torch.stack(list(verdicts.values()), dim=1)  # (B, 4): 1 shown, 0 not, NaN not asked
        total = share_of_asked_right(table) if self.total == "mean" else all_asked_right(table).float()
        return RewardOutput(total, {fact: v.nan_to_num(0.0) for fact, v in verdicts.items()})


def prompt_motion(prompt: str) -> Optional[tuple[int, int]]:
    """The (dx, dy) direction a prompt names: the first direction word after "moving" (else anywhere)."""
    words = re.findall(r"[a-z]+", prompt.lower())
    after = words[words.index("moving") + 1:] if "moving" in words else words
    word = next((w for w in after if w in MOTIONS), None) or next((w for w in words if w in MOTIONS), None)
    return MOTIONS[word] if word is not None else None


class MotionAlignment(Reward):
    """How far the shape moves the way its prompt says, a smooth reading of the synthetic world's motion.

    Per video: the background colour is the per-channel median of the border pixels of all frames; each
    pixel weighs ``min(|rgb - background| / softness, 1)`` (1 on the shape, 0 on the background, in between
    on blurred edges); the weighted centroid of each frame is a circular mean (the world wraps around);
    the reward is the first-to-last centroid displacement along the prompt's direction (wrapped to the
    short way round) divided by ``distance``, clipped to [-1, 1]. A prompt naming no direction, or a one-
    frame video, scores ``no_motion_reward``. Terms: ``displacement`` (along the direction, in frames).

    Args:
        distance: the displacement that scores 1 (the world's shapes move a quarter of the frame).
        softness: RGB distance (in [-1, 1] units) from the background at which a pixel counts fully.
        no_motion_reward: the reward of a sample without a direction or without motion to read.
    """

    def __init__(self, distance: float = 0.25, softness: float = 0.5, no_motion_reward: float = 0.0):
        if distance <= 0 or softness <= 0:
            raise ValueError(f"MotionAlignment: distance={distance} and softness={softness} must be > 0")
        self.distance, self.softness, self.no_motion_reward = distance, softness, no_motion_reward

    def __call__(self, media, prompts, context=None) -> RewardOutput:
        prompts = prompts_for_scoring(prompts, context)
        media = media.float()
        B, _, frames, H, W = media.shape
        border = torch.cat([media[..., 0, :], media[..., -1, :], media[..., :, 0], media[..., :, -1]], dim=-1)
        background = border.flatten(2).median(dim=-1).values  # (B, 3)
        weight = ((media - background[:, :, None, None, None]).norm(dim=1) / self.softness).clamp(max=1)  # (B, F, H, W)
        ys = ((torch.arange(H, device=media.device) + 0.5) / H).view(1, 1, H, 1)
        xs = ((torch.arange(W, device=media.device) + 0.5) / W).view(1, 1, 1, W)

        def circular(coords: torch.Tensor) -> torch.Tensor:  # (B, F) weighted mean position on the torus
            angle = 2 * math.pi * coords
            return torch.atan2((weight * angle.sin()).sum((2, 3)), (weight * angle.cos()).sum((2, 3))) / (2 * math.pi)

        cx, cy = circular(xs.expand_as(weight)), circular(ys.expand_as(weight))
        wrap = lambda d: torch.remainder(d + 0.5, 1.0) - 0.5  # noqa: E731
        dx, dy = wrap(cx[:, -1] - cx[:, 0]), wrap(cy[:, -1] - cy[:, 0])
        total = torch.full((B,), float(self.no_motion_reward), device=media.device)
        along = torch.zeros(B, device=media.device)
        for b, prompt in enumerate(prompts):
            direction = prompt_motion(prompt)
            if direction is not None and frames > 1:
                along[b] = dx[b] * direction[0] + dy[b] * direction[1]
                total[b] = (along[b] / self.distance).clamp(-1, 1)
        return RewardOutput(total, {"displacement": along})


class RefinementKeyword(Reward):
    """A text-side reward on the refiners' refinements: one term per expert, named after the expert.

    ``targets`` maps an expert to its target string. ``mode="fraction"``: the share of the refinement's
    characters covered by occurrences of the target (a one-character target: the fraction of that
    character); ``"contains"``: 1 if the target occurs, else 0. Matching ignores case unless
    ``case_sensitive``. The total is the mean of the terms. Reads ``context["refinements"]``.
    """

    def __init__(self, targets: dict[str, str], mode: Literal["fraction", "contains"] = "fraction",
                 case_sensitive: bool = False):
        problems = [f"expert {k!r} has an empty target" for k, v in targets.items() if not v]
        if not targets:
            problems.append("targets is empty; give e.g. {refiner_0: 'a', refiner_1: 'b'}")
        if problems:
            raise ValueError("RefinementKeyword:\n  - " + "\n  - ".join(problems))
        self.targets, self.mode, self.case_sensitive = dict(targets), mode, case_sensitive

    def text_score(self, text: str, target: str) -> float:
        if not self.case_sensitive:
            text, target = text.lower(), target.lower()
        if self.mode == "contains":
            return float(target in text)
        return text.count(target) * len(target) / max(len(text), 1)

    def __call__(self, media, prompts, context=None) -> RewardOutput:
        refinements = (context or {}).get("refinements")
        missing = sorted(set(self.targets) - set(refinements or {}))
        if missing:
            raise ValueError(f"reward 'RefinementKeyword' needs context['refinements'] for experts {missing}; "
                             f"got refinements of {sorted(refinements or {})} (it scores refiner LMs: use it "
                             f"with joint_rl)")
        B = len(prompts)
        device = media.device if isinstance(media, torch.Tensor) else None
        terms = {}
        for expert, target in self.targets.items():
            texts = refinements[expert]
            if len(texts) != B:
                raise ValueError(f"reward 'RefinementKeyword': {len(texts)} refinements of {expert!r} for {B} samples")
            terms[expert] = torch.tensor([self.text_score(t, target) for t in texts], device=device)
        total = torch.stack(list(terms.values())).mean(0)
        return RewardOutput(total, terms)
