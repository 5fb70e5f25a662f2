"""The shared GRPO pieces (modules/rl/grpo.py): the settings checked once, and the one rule for which rows train,
on one process and under DDP, for every RL method."""
from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer

from posttrain.datamodules.prompts import Prompts
from posttrain.lit.base import RunArgs
from posttrain.lit.flow_grpo import FlowGRPO
from posttrain.lit.joint_rl import JointRL
from posttrain.lit.workflow_rl import WorkflowRL
from posttrain.modules.models.cards import Expert, ModelCard
from posttrain.modules.rl.grpo import GRPOArgs, train_rows
from posttrain.modules.rl.refiner_args import RefinerArgs
from posttrain.modules.rewards.synthetic import ColourAlignment
from posttrain.modules.rewards.base import RewardOutput
from posttrain.modules.flow.samplers import FlowMatchSampler
from posttrain.modules.rl.workflow import Stage
from tests.conftest import TINY_WAN, adamw, workflow_experts
from tests.helpers import quick_trainer

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["a red circle moving left on a blue background", "a yellow square moving down on a magenta background"]


def test_grpo_settings_are_checked_once_all_in_one_list():
    problems = GRPOArgs(num_samples_per_prompt=1, timestep_fraction=0.0, clip_range=0.0, kl_beta=-1.0,
                        advantage_std="row", adv_clip=0.0, micro_batch_size=0, num_inner_epochs=0).problems("m")
    assert [p.split("=")[0] for p in problems] == [
        "grpo.num_samples_per_prompt", "grpo.timestep_fraction", "grpo.clip_range", "grpo.kl_beta",
        "grpo.advantage_std", "grpo.adv_clip", "grpo.micro_batch_size", "grpo.num_inner_epochs"]
    assert GRPOArgs().problems("m") == []
    # a setting the method does not read is refused, not ignored; at its default it is fine
    assert GRPOArgs(num_minibatches=2).problems("joint_rl", unused=("num_minibatches",)) == [
        "grpo.num_minibatches=2: joint_rl does not use it; remove it"]
    assert GRPOArgs().problems("joint_rl", unused=("num_minibatches",)) == []


def never(flag: bool) -> bool:
    raise AssertionError("a single process asks no other process")


def test_rows_with_signal_train_on_one_process():
    """One process: the rows with A ≠ 0 (of the candidates); none left: no step; drop_zero=False: every one."""
    a = torch.tensor([0.0, 1.5, 0.0, -0.5])
    assert train_rows(a, never, False).tolist() == [1, 3]
    assert train_rows(a, never, False, candidates=torch.tensor([0, 1, 2])).tolist() == [1]
    assert train_rows(torch.zeros(4), never, False).tolist() == []
    assert train_rows(torch.zeros(4), never, False, drop_zero=False).tolist() == [0, 1, 2, 3]


def test_under_ddp_every_process_trains_on_all_its_rows_when_any_has_signal():
    """DDP: the processes decide together. With signal on any process, each trains on all its candidates (the same
    row count everywhere, so the same backward passes and micro-batches), this one's A = 0 rows included; with
    signal nowhere, none steps."""
    asked = []

    def another_has_signal(flag: bool) -> bool:
        asked.append(flag)
        return True

    assert train_rows(torch.zeros(4), another_has_signal, True).tolist() == [0, 1, 2, 3]
    assert train_rows(torch.tensor([0.0, 2.0, 0.0, 0.0]), another_has_signal, True,
                      candidates=torch.tensor([0, 1, 2])).tolist() == [0, 1, 2]
    assert asked == [False, True]
    assert train_rows(torch.zeros(4), lambda flag: flag, True).tolist() == []


class RedOnly(ColourAlignment):
    """Colour alignment for prompts that name red, a constant otherwise: the other prompt's group has A = 0."""

    def __call__(self, media, prompts, context=None):
        out = super().__call__(media, prompts, context)
        red = torch.tensor(["red" in p for p in prompts])
        return RewardOutput(torch.where(red, out.total, torch.full_like(out.total, 0.5)), {})


def wan_card(**extra) -> ModelCard:
    return ModelCard({"text_encoder": Expert(arch="umt5"), "vae": Expert(arch="wan_vae"),
                      "transformer": Expert(arch="wan_t2v", preset=TINY_WAN, trainable=True, optimizer=adamw(1e-3))},
                     text_max_length=96, **extra)


GRPO = GRPOArgs(num_samples_per_prompt=2, timestep_fraction=1.0, kl_beta=0.004)
SMALL = RunArgs(frames=5, height=16, width=16)


def flow_grpo():
    return FlowGRPO(wan_card(), FlowMatchSampler(num_steps=2), reward=RedOnly(), grpo=GRPO, run=SMALL), 4


def joint_rl():
    card = wan_card(num_refiners=1, refiner=Expert(arch="qwen2", trainable=True, optimizer=adamw(1e-3)))
    # append: the request stays in the served prompt, so RedOnly's split into a signal group and an A = 0 group holds
    return JointRL(card, FlowMatchSampler(num_steps=2), reward=RedOnly(), grpo=GRPO,
                   refiners=RefinerArgs(num_unrefined=0, max_new_tokens=2, mode="append"), run=SMALL), 4


def workflow_rl():
    experts = workflow_experts(t2i_trainable=False)
    stages = [Stage("t2i", sampler=FlowMatchSampler(num_steps=2), frames=1, height=16, width=16, trainable=False),
              Stage("i2v", sampler=FlowMatchSampler(num_steps=2), frames=5, height=16, width=16)]
    return WorkflowRL(ModelCard(experts, text_max_length=64), stages, reward=RedOnly(), grpo=GRPO), 4


@pytest.mark.parametrize("make", [flow_grpo, joint_rl, workflow_rl], ids=["flow_grpo", "joint_rl", "workflow_rl"])
def test_every_rl_method_follows_the_ddp_rule(make, monkeypatch):
    """A process whose batch holds one group with signal and one with A = 0, as one of two DDP processes: every
    method trains its generator on all 4 candidate rows (before, joint_rl and workflow_rl took the 2 with signal,
    so two processes could run different numbers of micro-batches); on one process, on the 2 with signal."""
    for world, kept in ((1, 2), (2, 4)):
        module, candidates = make()
        monkeypatch.setattr(Trainer, "world_size", property(lambda self: world))  # the collective is the identity
        quick_trainer(1).fit(module, Prompts(prompts=PROMPTS, batch_size=2))
        monkeypatch.undo()
        generator = module.stage.transformer
        assert module.trainer.callback_metrics[f"train/kept_samples/{generator}"].item() == kept
        assert module.card.versions[generator] == 1
