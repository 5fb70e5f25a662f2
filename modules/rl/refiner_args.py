"""How joint RL's prompt refiners write, are served and are trained: one group of settings, declared, documented
and checked once (as ``GRPOArgs`` is for the group and the generator's update).

Per request, K samples form a group (``grpo.num_samples_per_prompt``); each refiner LM writes its own refinement for
K − ``num_unrefined`` of them, and the other ``num_unrefined`` are served the request itself, so a group contrasts
refined against unrefined. The refinements compose, in refiner order, into the prompt the generator is served
(``mode``, ``concerns``); each trained refiner takes a token policy gradient plus a k3 KL to its frozen reference,
weighted by ``kl_beta`` (``modules/models/refiners.py``, ``refiner_loss``).

A config sets them under ``model.init_args`` as ``refiners: {mode: rewrite, concerns: [shape, colours, motion],
kl_beta: 0.03}`` (``configs/joint_rl.yaml``); which LMs refine (how many, their weights, their optimizer) is the
card's ``num_refiners`` and ``refiner``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union, get_args

Concern = Literal["shape", "colours", "motion"]  # the world's concerns (``modules/world/requests.py``, CONCERNS)


@dataclass
class RefinerArgs:
    """Args:
        mode: ``rewrite``: the refinement replaces the request (what a pretrained rewriter is for); ``append``: it
            follows the request (``request, refinement``).
        concerns: refiner i writes concern ``concerns[i]`` (``shape``, ``colours`` or ``motion``) and the parts
            compose into the world's caption (``requests.compose_concerns``); None = each refiner writes a whole
            refinement (N > 1: joined by ``", "``). Give the reward the same map (``IntentReward(concerns={refiner_0:
            shape, ...})``) so per-expert credit scores each refiner on the facts it writes.
        max_new_tokens: longest refinement, in tokens; None = sized for the task (``requests.refinement_tokens``: a
            whole caption, 56 bytes, or the refiner's concern).
        temperature: the refiners' sampling temperature (training, and serving with ``serve: sample``).
        serve: how the refiners write when the system serves (``generate``, validation, predict): ``sample`` at
            ``temperature``, as in training, or ``greedy`` (each refiner's most likely text: what rewrite accuracy
            reports; after RL its sampled rewrites are right less often, ``docs/rl/rewrite_gap.md``).
        template: each refiner's chat-free context, formatted with ``prompt``: one for all or one per refiner;
            None = the task's own (``requests.REWRITE_TEMPLATE`` ``"{prompt}\\n"``, or the concern's
            ``requests.CONCERN_TEMPLATES``, as the shipped refiner was pretrained).
        kl_beta: weight of each trained refiner's k3 KL to its frozen reference.
        num_unrefined: how many of each request's K samples are served the request verbatim (no refinement).
    """

    mode: Literal["rewrite", "append"] = "rewrite"
    concerns: Optional[list[Concern]] = None
    max_new_tokens: Optional[int] = None
    temperature: float = 1.0
    template: Union[str, list[str], None] = None
    kl_beta: float = 0.01
    num_unrefined: int = 1
    serve: Literal["sample", "greedy"] = "sample"

    def problems(self, refiners: list[str], num_samples_per_prompt: int,
                 reward_concerns: Optional[dict[str, str]] = None) -> list[str]:
        """Every problem of these settings for the card's ``refiners``, groups of ``num_samples_per_prompt`` and a
        reward that scores each refiner on the concern ``reward_concerns`` gives it (None or empty: no such map),
        each naming ``refiners.<option>``, its value and the fix."""
        num_refiners = len(refiners)
        problems = []
        K = num_samples_per_prompt
        if not 0 <= self.num_unrefined < K:
            problems.append(f"refiners.num_unrefined={self.num_unrefined} must be in [0, grpo.num_samples_per_prompt="
                            f"{K}): at least one sample per prompt must use the refinements")
        if self.mode not in ("rewrite", "append"):
            problems.append(f"refiners.mode={self.mode!r}; choose 'rewrite' (the refinement replaces the request) or "
                            f"'append' (it follows the request)")
        if self.concerns is not None:
            known = get_args(Concern)
            concerns = list(self.concerns)
            if any(c not in known for c in concerns) or len(set(concerns)) != len(concerns) \
                    or len(concerns) != num_refiners:
                problems.append(f"refiners.concerns={concerns} must give each of the {num_refiners} refiners its own "
                                f"concern, one of {list(known)} (e.g. [shape, colours, motion] for 3), or be null")
            elif reward_concerns and dict(reward_concerns) != dict(zip(refiners, concerns)):
                wanted = dict(zip(refiners, concerns))
                problems.append(f"the reward's concerns {dict(reward_concerns)} are not the refiners' {wanted}: each "
                                f"refiner must be scored on the concern it writes; give the reward concerns={wanted}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            problems.append(f"refiners.max_new_tokens={self.max_new_tokens} must be >= 1 (or null: sized for the task)")
        if self.temperature <= 0:
            problems.append(f"refiners.temperature={self.temperature} must be > 0")
        templates = self.template if isinstance(self.template, list) else [self.template]
        if isinstance(self.template, list) and len(self.template) != num_refiners:
            problems.append(f"refiners.template gives {len(self.template)} templates for {num_refiners} refiners: "
                            f"give one for all, or one per refiner")
        problems += [f"refiners.template={t!r} must contain '{{prompt}}'" for t in templates
                     if t is not None and "{prompt}" not in t]
        if self.kl_beta < 0:
            problems.append(f"refiners.kl_beta={self.kl_beta} must be >= 0")
        if self.serve not in ("sample", "greedy"):
            problems.append(f"refiners.serve={self.serve!r}; choose 'sample' (at refiners.temperature) or 'greedy'")
        return problems


# joint_rl's former flat keys and their place in this group (the CLI's error for an old config names it)
MOVED = {"num_skip_refinement": "refiners.num_unrefined", "mode": "refiners.mode", "concerns": "refiners.concerns",
         "max_new_tokens": "refiners.max_new_tokens", "temperature": "refiners.temperature",
         "refiner_template": "refiners.template", "refiner_kl": "refiners.kl_beta"}
