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

A reward that holds models names them (``Reward.models``), so that whoever places or counts them (``posttrain
estimate``) asks the reward instead of knowing its class. Every file of this folder is imported by the package
(``modules/rewards/__init__.py``), which is what lets a config name a reward by its class alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn


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

    def models(self) -> dict[str, nn.Module]:
        """The frozen models this reward holds in this process, by name (none by default; one served elsewhere holds
        none). A reward that loads its model on first use returns it built on the meta device until then (shapes
        and dtypes, no weights), so it can be counted before it runs."""
        return {}


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


def models_of(reward: Any) -> dict[str, nn.Module]:
    """``reward.models()``; none for a plain callable used as a reward."""
    models = getattr(reward, "models", None)
    return dict(models()) if callable(models) else {}


def reward_models(reward: Any, prefix: str = "reward") -> dict[str, nn.Module]:
    """The models a reward holds, named ``<prefix>/<name>`` (the rows ``posttrain estimate`` counts)."""
    return {f"{prefix}/{name}": model for name, model in models_of(reward).items()}


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

    def models(self) -> dict[str, nn.Module]:
        return models_of(self.reward)


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

    def models(self) -> dict[str, nn.Module]:
        """Every part's models, named ``<part>/<name>``."""
        return {f"{key}/{name}": model for key, part in self.rewards.items() for name, model in models_of(part).items()}
