"""The reward of a user request: synthetic GenEval of the *intent*, whatever text the generator was served.

A request (``modules/world/requests.py``) asks for facts; a refiner may rewrite it, or append to it, before the
generator sees it. ``IntentReward`` scores the video against the facts the request asked for, read in
this order:

1. ``context["facts"]``: a list of B ``Facts`` (a method passes the batch's, ``requests.facts_from_batch``,
   repeated per sample);
2. else ``context["original_prompts"]`` (the requests before refinement, joint RL) read by
   ``requests.parse_request``;
3. else the prompts themselves, read the same way (a request served verbatim, e.g. flow_grpo on requests).

Never the served prompt of a refined sample: a rewrite that says something else is scored on what the user
asked. One term per fact (1 shown, 0 not; 0 when the request leaves the fact out), the total their mean over
the facts asked (``total="mean"``) or 1 when all are shown (``"all"``), as ``SyntheticGenEvalReward``.

For N = 3 refiners with one concern each (``requests.CONCERNS``: the shape word, the colours, the motion),
``concerns`` names the expert of each concern; the reward then adds one term per expert, the mean of its
concern's facts asked (0 when the request asks none of them: no signal for that refiner), so per-expert
credit (``term_of``) hands each refiner the score of the facts it writes:

    IntentReward(concerns={"refiner_0": "shape", "refiner_1": "colours", "refiner_2": "motion"})
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Sequence

import torch

from posttrain.modules.world.geneval import judge_facts
from posttrain.modules.world.requests import CONCERNS, parse_request
from posttrain.modules.rewards.synthetic import SyntheticGenEvalReward
from posttrain.modules.world.world import FACTS, Facts


def asked_facts(prompts: Sequence[str], context: Optional[dict[str, Any]] = None) -> list[Facts]:
    """The facts each sample's request asks for (see the module docstring for where they are read)."""
    context = context or {}
    if context.get("facts") is not None:
        facts = list(context["facts"])
        if len(facts) != len(prompts) or not all(isinstance(f, Facts) for f in facts):
            raise ValueError(f"reward context 'facts' must be {len(prompts)} Facts, one per sample; got "
                             f"{[type(f).__name__ for f in facts][:4]}… ({len(facts)}): pass "
                             f"requests.facts_from_batch(batch), repeated per sample")
        return facts
    texts = list(context["original_prompts"]) if context.get("original_prompts") is not None else list(prompts)
    facts = [parse_request(text) for text in texts]
    unread = [text for text, f in zip(texts, facts) if all(getattr(f, k) is None for k in FACTS)]
    if unread:
        raise ValueError(f"IntentReward: request {unread[0]!r} asks for no shape, colour, background or motion "
                         f"this grammar knows (modules/world/requests.py LEXICON); pass the requests' facts as "
                         f"context['facts'], or score requests of datamodules.requests.Requests")
    return facts


class IntentReward(SyntheticGenEvalReward):
    """Synthetic GenEval of the request's facts (module docstring).

    Args:
        total: how the facts combine into the total (``mean`` of those asked, or ``all`` shown).
        min_motion: the shape's path, in frames, below which the video shows no motion.
        concerns: expert name -> concern (``shape``, ``colours`` or ``motion``): adds a term per expert.
    """

    def __init__(self, total: Literal["mean", "all"] = "mean", min_motion: float = 0.05,
                 concerns: Optional[dict[str, Literal["shape", "colours", "motion"]]] = None):
        super().__init__(total, min_motion)
        bad = {e: c for e, c in (concerns or {}).items() if c not in CONCERNS}
        if bad:
            raise ValueError(f"IntentReward: concerns {bad} unknown; map each expert to one of {list(CONCERNS)}")
        clash = sorted(set(concerns or {}) & set(FACTS))
        if clash:
            raise ValueError(f"IntentReward: concerns name experts {clash}, which are the fact terms' names; "
                             f"name the refiners (refiner_0, …)")
        self.concerns = dict(concerns or {})

    def verdicts(self, media, prompts, context=None) -> dict[str, torch.Tensor]:
        return judge_facts(media.detach(), asked_facts(prompts, context), self.min_motion)

    def __call__(self, media, prompts, context=None):
        verdicts = self.verdicts(media, prompts, context)
        out = self.combine(verdicts)
        for expert, concern in self.concerns.items():
            table = torch.stack([verdicts[f] for f in CONCERNS[concern]], dim=1)  # (B, facts of the concern)
            asked = (~table.isnan()).sum(1)
            out.terms[expert] = table.nan_to_num(0.0).sum(1) / asked.clamp(min=1)
        return out

