"""Rewards: ``reward(media, prompts, context=None) -> RewardOutput`` (the interface is ``base``).

Importing this package registers every reward class here, so a config may name one by its class alone
(``reward: {class_path: PickScore}``) or by ``posttrain.modules.rewards.<Name>``. A new reward is a new file in this
folder, imported below.
"""
from posttrain.modules.rewards.base import (ConstantReward, Reward, RewardOutput, StageReward, WeightedReward,
                                             check_reward_output, credited_term, prompts_for_scoring, reward_name,
                                             score, term_of, term_problems)
from posttrain.modules.rewards.image import CLIPScore, JpegCompressibility
from posttrain.modules.rewards.synthetic import (PALETTE, ColourAlignment, MotionAlignment, RefinementKeyword,
                                                  SyntheticGenEvalReward, prompt_motion)
from posttrain.modules.rewards.intent import IntentReward
from posttrain.modules.rewards.preference import HPSv21, LaionAesthetic, PickScore
from posttrain.modules.rewards.remote import RemoteReward

__all__ = ["CLIPScore", "ColourAlignment", "ConstantReward", "HPSv21", "IntentReward", "JpegCompressibility",
           "LaionAesthetic", "MotionAlignment", "PALETTE", "PickScore", "RefinementKeyword", "RemoteReward", "Reward",
           "RewardOutput", "StageReward", "SyntheticGenEvalReward", "WeightedReward", "check_reward_output",
           "credited_term", "prompt_motion", "prompts_for_scoring", "reward_name", "score", "term_of", "term_problems"]
