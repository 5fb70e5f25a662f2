"""Rewards: ``reward(media, prompts, context=None) -> RewardOutput`` (the interface is ``base``).

This package imports every module in its folder and exports every reward class they define (each subclass of
``base.Reward``), so a config may name one by its class alone (``reward: {class_path: PickScore}``) or by
``posttrain.modules.rewards.<Name>``, and a new reward is one new file here and no edit elsewhere. A method's
``reward: Reward`` argument imports ``base`` through this package, which is what registers them all.
"""
import importlib
import pkgutil

from posttrain.modules.rewards.base import (ConstantReward, Reward, RewardOutput, StageReward, WeightedReward,
                                             check_reward_output, credited_term, prompts_for_scoring, reward_name,
                                             score, term_of, term_problems)

__all__ = ["ConstantReward", "Reward", "RewardOutput", "StageReward", "WeightedReward", "check_reward_output",
           "credited_term", "prompts_for_scoring", "reward_name", "score", "term_of", "term_problems"]


def _rewards() -> dict[str, type]:
    """The public ``Reward`` subclasses every module of this package defines, by class name."""
    found: dict[str, type] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, type) and issubclass(value, Reward) and value.__module__ == module.__name__ \
                    and not name.startswith("_"):
                if name in found and found[name] is not value:
                    raise ValueError(f"reward {name!r} is defined twice in modules/rewards/ (again in {info.name}.py)")
                found[name] = value
    return found


REWARDS: dict[str, type] = _rewards()  # every reward class, by name
globals().update(REWARDS)
__all__ += sorted(set(REWARDS) - set(__all__))
