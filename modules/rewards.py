"""Rewards: ``reward(media, prompts, context=None) -> RewardOutput``.

``media`` is (B, 3, F, H, W) in [-1, 1] (an image is a one-frame video); ``prompts`` the B prompts the
samples were generated from; ``context`` an optional dict a method fills:

- ``"original_prompts"``: the user's prompts before any refinement (joint RL), list[str] of B;
- ``"refinements"``: ``{expert_name: list[str] of B}``, each refiner's text for each sample (joint RL);
- ``"stages"``: ``{stage_name: (B, 3, F, H, W)}``, every generator stage's media of a workflow (the
  image a video was made from), read by ``StageReward``.

A reward returns a total (B,) and named terms (B,) each, so per-expert credit can read a term: the
terms of ``RefinementKeyword`` are named after the experts (``refiner_0``…), and ``WeightedReward``
prefixes the terms of its parts (``keyword/refiner_0``); ``term_of`` finds an expert's term either way.
Every call a method makes goes through ``score``, which checks shape and finiteness and names the
reward in the error. Built-ins need no downloaded model, except ``CLIPScore`` on a local path.
"""
from __future__ import annotations

import io
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch

from posttrain.modules.geneval import judge
from posttrain.modules.world import MOTIONS  # (dx, dy) of each direction, in frame fractions

# The palette of the synthetic shape videos (``posttrain.datamodules.synthetic.COLOURS``, RGB in [0, 1]). A copy,
# because modules/ must not import the datamodules (they import Lightning); a test keeps them equal.
PALETTE: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.1, 0.1), "green": (0.1, 0.8, 0.2), "blue": (0.15, 0.25, 1.0),
    "yellow": (1.0, 0.9, 0.1), "magenta": (0.9, 0.1, 0.9), "cyan": (0.1, 0.9, 0.9),
}


@dataclass
class RewardOutput:
    """Per-sample reward ``total`` (B,) and its named ``terms`` (B,) each."""

    total: torch.Tensor
    terms: dict[str, torch.Tensor] = field(default_factory=dict)


class Reward:
    """Base of every reward (the type LightningCLI resolves ``class_path`` against)."""

    @property
    def name(self) -> str:
        return type(self).__name__

    def __call__(self, media: torch.Tensor, prompts: list[str],
                 context: Optional[dict[str, Any]] = None) -> RewardOutput:
        raise NotImplementedError


def check_reward_output(out: Any, batch_size: int, name: str) -> RewardOutput:
    """``out`` as a checked ``RewardOutput``: total and every term a finite float tensor of shape (B,).

    A bare (B,) tensor is accepted as a total without terms. Errors name the reward and the value.
    """
    if isinstance(out, torch.Tensor):
        out = RewardOutput(out, {})
    if not isinstance(out, RewardOutput):
        raise TypeError(f"reward {name!r} returned {type(out).__name__}; return a RewardOutput or a (B,) tensor")
    for label, value in [("total", out.total)] + [(f"term {k!r}", v) for k, v in out.terms.items()]:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"reward {name!r}: {label} is {type(value).__name__}, expected a tensor of shape "
                            f"({batch_size},)")
        if tuple(value.shape) != (batch_size,):
            raise ValueError(f"reward {name!r}: {label} has shape {tuple(value.shape)}, expected ({batch_size},) "
                             f"— one value per sample")
        if not torch.isfinite(value).all():
            bad = [i for i, ok in enumerate(torch.isfinite(value).tolist()) if not ok]
            raise ValueError(f"reward {name!r}: {label} is not finite for samples {bad}: {value.tolist()}; make the "
                             f"reward return finite values (guard its divisions and empty masks)")
    return RewardOutput(out.total.float(), {k: v.float() for k, v in out.terms.items()})


def reward_name(reward: Any) -> str:
    return getattr(reward, "name", None) or getattr(reward, "__name__", None) or type(reward).__name__


@torch.no_grad()
def score(reward: Any, media: torch.Tensor, prompts: list[str],
          context: Optional[dict[str, Any]] = None) -> RewardOutput:
    """Call ``reward`` and check what it returns (see ``check_reward_output``)."""
    if media.ndim != 5 or media.shape[1] != 3:
        raise ValueError(f"rewards take (B, 3, F, H, W) media in [-1, 1]; got shape {tuple(media.shape)}")
    if len(prompts) != media.shape[0]:
        raise ValueError(f"{len(prompts)} prompts for {media.shape[0]} samples")
    return check_reward_output(reward(media, prompts, context), media.shape[0], reward_name(reward))


def term_of(out: RewardOutput, expert: str) -> torch.Tensor:
    """The term an expert is credited with: named ``expert`` or ending in ``/expert`` (WeightedReward)."""
    matches = [k for k in out.terms if k == expert or k.endswith("/" + expert)]
    if len(matches) != 1:
        raise KeyError(f"per-expert credit needs exactly one reward term named {expert!r} (or '<reward>/{expert}'); "
                       f"the reward's terms are {sorted(out.terms)}")
    return out.terms[matches[0]]


def credited_term(out: RewardOutput, name: str, method: str) -> torch.Tensor:
    """``term_of`` for a method's credit by reward term: a missing term is a ``ValueError`` naming ``method``."""
    try:
        return term_of(out, name)
    except KeyError as err:
        raise ValueError(f"{method} credit by reward term: {err.args[0]}") from err


def term_problems(reward: Any, needed: list[tuple[str, str, str]], media: torch.Tensor, prompts: list[str],
                  context: Optional[dict[str, Any]] = None) -> list[str]:
    """Start-up check of credit read from reward terms: score one dry run of ``media`` (shaped as the method's
    will be) and name each ``(term, option, fix)`` of ``needed`` whose term the reward does not return."""
    try:
        out = score(reward, media, prompts, context)
    except Exception as err:  # noqa: BLE001 - reported as a config problem, with the reward's own message
        options = ", ".join(dict.fromkeys(option for _, option, _ in needed))
        return [f"{options}: the reward failed on a dry run ({type(err).__name__}: {err})"]
    problems = []
    for term, option, fix in needed:
        try:
            term_of(out, term)
        except KeyError:
            problems.append(f"{option} needs a reward term for {term!r}, but the reward's terms are "
                            f"{sorted(out.terms)}: {fix}")
    return problems


def prompts_for_scoring(prompts: list[str], context: Optional[dict[str, Any]]) -> list[str]:
    """What a media reward compares against: the user's original prompt when a method refined it."""
    if context and context.get("original_prompts") is not None:
        return list(context["original_prompts"])
    return list(prompts)


# ---------------------------------------------------------------------------------------- media rewards
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
    the prompt names, else 0, read back from pixels by ``modules/geneval.py``) and a total of either the
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
        asked = ~table.isnan()
        if self.total == "mean":
            total = table.nan_to_num(0.0).sum(1) / asked.sum(1)
        else:
            total = (table.nan_to_num(1.0) == 1).all(1).float()
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


class StageReward(Reward):
    """``reward`` applied to an intermediate stage's media of a workflow (``context["stages"][stage]``), e.g.
    the colour of the image a video was made from: a reward on the final video whose term reads the image.

    Args:
        reward: the reward to apply.
        stage: the workflow stage whose media it scores.
    """

    def __init__(self, reward: Reward, stage: str):
        self.reward, self.stage = reward, stage

    @property
    def name(self) -> str:
        return f"{reward_name(self.reward)}@{self.stage}"

    def __call__(self, media, prompts, context=None) -> RewardOutput:
        stages = (context or {}).get("stages") or {}
        if self.stage not in stages:
            raise ValueError(f"reward {self.name!r} scores the media of workflow stage {self.stage!r}, but the "
                             f"context holds stages {sorted(stages)}: use it with workflow_rl and name one of them")
        return check_reward_output(self.reward(stages[self.stage], prompts, context), len(prompts), self.name)


class JpegCompressibility(Reward):
    """JPEG size of the frames (Flow-GRPO's compressibility reward): ``-kB`` per frame, or ``+kB``
    with ``incompressible``. Frames are encoded with Pillow at ``quality``; the size is averaged over
    frames. Term: ``kb``."""

    def __init__(self, quality: int = 95, incompressible: bool = False):
        if not 1 <= quality <= 100:
            raise ValueError(f"JpegCompressibility: quality={quality} must be in [1, 100]")
        self.quality, self.incompressible = quality, incompressible

    @property
    def name(self) -> str:
        return "JpegIncompressibility" if self.incompressible else "JpegCompressibility"

    def __call__(self, media, prompts, context=None) -> RewardOutput:
        from PIL import Image

        frames = ((media.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        frames = frames.permute(0, 2, 3, 4, 1).cpu().numpy()  # (B, F, H, W, 3)
        kb = torch.zeros(media.shape[0])
        for b in range(frames.shape[0]):
            sizes = []
            for frame in frames[b]:
                buf = io.BytesIO()
                Image.fromarray(frame).save(buf, format="JPEG", quality=self.quality)
                sizes.append(buf.tell() / 1000)
            kb[b] = sum(sizes) / len(sizes)
        kb = kb.to(media.device)
        return RewardOutput(kb if self.incompressible else -kb, {"kb": kb})


class CLIPScore(Reward):
    """Cosine similarity of CLIP image and text embeddings, averaged over frames, from a **local**
    ``transformers`` CLIP folder (``CLIPModel`` + ``CLIPProcessor``; nothing is downloaded), computed as
    torchmetrics' ``CLIPScore`` computes it per sample (``modules/clip.py``; the ``Evaluate`` callback's
    ``clip_score`` metric reads the same folder the same way). The model loads on first use. Scores the
    original prompt under joint RL.

    Args:
        path: a local folder holding a CLIP model and its processor.
        frames: how many evenly spaced frames to score per video.
    """

    def __init__(self, path: str, frames: int = 4):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"CLIPScore: path={path!r} is not a local folder; give the folder of a "
                                    f"transformers CLIP model (CLIPModel.save_pretrained), nothing is downloaded")
        self.path, self.frames = path, frames
        self._clip = None

    def __call__(self, media, prompts, context=None) -> RewardOutput:
        from posttrain.modules.clip import clip_cosines, load_clip

        if self._clip is None:
            self._clip = load_clip(self.path)
        prompts = prompts_for_scoring(prompts, context)
        B, _, n_frames, _, _ = media.shape
        idx = torch.linspace(0, n_frames - 1, min(self.frames, n_frames)).round().long().to(media.device)
        images = media[:, :, idx].permute(0, 2, 1, 3, 4).flatten(0, 1)  # (B·f, 3, H, W)
        texts = [p for p in prompts for _ in range(len(idx))]
        total = clip_cosines(*self._clip, images, texts).view(B, len(idx)).mean(1).to(media.device)
        return RewardOutput(total, {"cosine": total})


# ---------------------------------------------------------------------------------------- text rewards
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


class ConstantReward(Reward):
    """The same reward for every sample: a control (zero advantage everywhere, so no update)."""

    def __init__(self, value: float = 1.0):
        self.value = value

    def __call__(self, media, prompts, context=None) -> RewardOutput:
        return RewardOutput(torch.full((len(prompts),), float(self.value), device=media.device), {})


# ---------------------------------------------------------------------------------------- combination
class WeightedReward(Reward):
    """``total = Σ_k w_k · total_k``. Terms: each part's total as ``<k>`` and its terms as ``<k>/<term>``
    (unweighted), so ``term_of(out, "refiner_0")`` finds ``keyword/refiner_0``.

    Args:
        rewards: name -> reward.
        weights: name -> weight; a missing name weighs 1.
    """

    def __init__(self, rewards: dict[str, Reward], weights: Optional[dict[str, float]] = None):
        weights = dict(weights or {})
        problems = []
        if not rewards:
            problems.append("rewards is empty")
        unknown = sorted(set(weights) - set(rewards))
        if unknown:
            problems.append(f"weights name rewards {unknown} that are not in rewards {sorted(rewards)}")
        for k, w in weights.items():
            if not math.isfinite(w):
                problems.append(f"weight of {k!r} is {w}")
        if problems:
            raise ValueError("WeightedReward:\n  - " + "\n  - ".join(problems))
        self.rewards = dict(rewards)
        self.weights = {k: float(weights.get(k, 1.0)) for k in rewards}

    def __call__(self, media, prompts, context=None) -> RewardOutput:
        B = len(prompts)
        total = None
        terms: dict[str, torch.Tensor] = {}
        for key, reward in self.rewards.items():
            out = check_reward_output(reward(media, prompts, context), B, f"{key} ({reward_name(reward)})")
            terms[key] = out.total
            terms.update({f"{key}/{t}": v for t, v in out.terms.items()})
            part = self.weights[key] * out.total
            total = part if total is None else total + part
        return RewardOutput(total, terms)
