"""Runs over seeds against a zero-learning-rate control, as the experiments compare them: the overrides that set one
seed on all three RNGs of a run, those that zero every optimizer's learning rate of a config, and a table cell that
reads ``before → after`` (one seed) or ``before → mean [min, max]`` (several).
"""
from __future__ import annotations

from statistics import mean

import yaml


def seed_overrides(seed: int) -> list[str]:
    """One seed on the three RNGs of a run (global, data, the method's noise)."""
    return [f"--seed_everything={seed}", f"--data.init_args.seed={seed}", f"--model.init_args.run.seed={seed}"]


def zero_lr_overrides(config: str) -> list[str]:
    """``--...lr=0`` for every optimizer of the config's card (each expert's, and the refiner template's)."""
    with open(config) as f:
        card = yaml.safe_load(f)["model"]["init_args"]["card"]
    paths = [f"experts.{name}" for name, spec in (card.get("experts") or {}).items() if (spec or {}).get("optimizer")]
    paths += ["refiner"] if (card.get("refiner") or {}).get("optimizer") else []
    if not paths:
        raise SystemExit(f"{config}: no expert with an optimizer, nothing to zero for a control")
    return [f"--model.init_args.card.{path}.optimizer.init_args.lr=0.0" for path in paths]


def cell(before: float, afters: list[float]) -> str:
    """``before → after`` for one run, ``before → mean [min, max]`` for several."""
    if len(afters) == 1:
        return f"{before:.3f} → {afters[0]:.3f}"
    return f"{before:.3f} → {mean(afters):.3f} [{min(afters):.3f}, {max(afters):.3f}]"
