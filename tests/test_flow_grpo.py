"""FlowGRPO end to end: real Trainer.fit on CPU with tiny presets of the real classes."""
import dataclasses

import pytest
import torch
import yaml

from posttrain.callbacks.parity import LogProbParityCheck, LogProbParityError
from posttrain.datamodules.prompts import Prompts
from posttrain.lit.tools.config import PosttrainCLI
from posttrain.lit.base import RunArgs
from posttrain.lit.flow_grpo import FlowGRPO
from posttrain.modules.models.cards import Expert, ModelCard
from posttrain.modules.rl.grpo import GRPOArgs
from posttrain.modules.rewards.synthetic import ColourAlignment, SyntheticGenEvalReward
from posttrain.modules.rewards.base import ConstantReward, RewardOutput, score
from posttrain.modules.rl.rollout import Rollout
from posttrain.modules.flow.samplers import FlowMatchSampler
from tests.conftest import TINY_WAN, adamw
from tests.helpers import assert_one_metric_scheme, quick_trainer

PROMPTS = ["a red circle moving left on a blue background", "a yellow square moving down on a magenta background"]
VAE = Expert(arch="wan_vae")
VIDEO = dict(run=RunArgs(frames=5, height=16, width=16))


pytestmark = pytest.mark.usefixtures("one_thread")


def rl_card(lr: float) -> ModelCard:
    return ModelCard({"text_encoder": Expert(arch="umt5"), "vae": VAE,
                      "transformer": Expert(arch="wan_t2v", preset=TINY_WAN, trainable=True, optimizer=adamw(lr))}, text_max_length=32)


def make(lr: float = 1e-3, reward=None, grpo=None, **kwargs) -> FlowGRPO:
    defaults = dict(sampler=FlowMatchSampler(num_steps=8), **VIDEO)
    defaults.update(kwargs)
    grpo = {"num_samples_per_prompt": 4, "timestep_fraction": 1.0, "kl_beta": 0.004, **(grpo or {})}
    return FlowGRPO(rl_card(lr), reward=reward, grpo=GRPOArgs(**grpo), **defaults)


def eval_reward(model) -> float:
    """Mean reward of fixed-seed ODE samples of the training prompts."""
    model.eval()
    return score(model.reward, model.generate(PROMPTS, seed=123), PROMPTS).total.mean().item()


@pytest.mark.slow
def test_flow_grpo_raises_the_colour_reward_with_logprob_parity_holding():
    torch.manual_seed(0)
    model = make()
    model.configure_model()
    before = eval_reward(model)
    weights0 = {k: v.clone() for k, v in model.card["transformer"].state_dict().items()}
    parity = LogProbParityCheck(every_n_iterations=5, tolerance=1e-5)
    quick_trainer(40, callbacks=[parity]).fit(model, Prompts(prompts=PROMPTS, batch_size=2))
    after = eval_reward(model)
    metrics = model.trainer.callback_metrics
    # learning: the deterministic ODE samples' reward rises clearly (a broken sign lowers it)
    print(f"flow_grpo reward {before:.4f} -> {after:.4f}")
    assert after > before + 1e-2, (before, after)
    assert any(not torch.equal(weights0[k], v) for k, v in model.card["transformer"].state_dict().items())
    # log-probability parity at rollout weights (float32): checked on iterations 0, 5, ..., 35; PPO ratio stays near 1
    assert parity.checks == 8 and parity.last_gap < 1e-5
    assert abs(metrics["train/ppo_ratio_mean/transformer"].item() - 1) < 1e-2
    for name in ("train/reward", "train/reward_std", "train/clip_frac/transformer", "train/kl/transformer",
                 "train/loss/transformer", "train/logprob_parity_gap", "train/grad_norm/transformer"):
        assert name in metrics, name
    assert_one_metric_scheme(metrics, model.card)
    # one version per iteration; the frozen reference and text encoder never move
    assert model.card.versions["transformer"] == 40
    assert model.card.versions["transformer_reference"] == 0 and model.card.versions["text_encoder"] == 0
    assert model.trainer.global_step == 40


def shipped() -> dict:
    """configs/flow_grpo.yaml's RL settings: its ``grpo:`` and its sampler's SDE (noise level, window)."""
    init = yaml.safe_load(open("configs/flow_grpo.yaml"))["model"]["init_args"]
    sde = {k: v for k, v in init["sampler"]["init_args"].items() if k in ("noise_level", "sde_window")}
    return dict(grpo=init["grpo"], sampler=FlowMatchSampler(num_steps=8, **sde))


@pytest.mark.slow
def test_shipped_settings_learn_against_a_zero_lr_control():
    """The shipped config's GRPO settings and SDE noise, on the tiny generator: after 20 iterations the reward of
    fixed-noise ODE samples is clearly above a control run that sees the same rollouts at learning rate 0 (which
    is what removing the update leaves)."""
    settings, after = shipped(), {}
    for lr in (0.0, 1e-3):
        torch.manual_seed(0)
        model = make(lr, **settings)
        quick_trainer(20).fit(model, Prompts(prompts=PROMPTS, batch_size=2))
        after[lr] = eval_reward(model)
    print(f"flow_grpo shipped settings: control {after[0.0]:.4f}, trained {after[1e-3]:.4f}")
    assert after[1e-3] > after[0.0] + 0.03, after


def test_constant_reward_changes_nothing():
    """Zero advantage everywhere: no sample survives, no optimizer step, weights bitwise unchanged."""
    model = make(reward=ConstantReward(0.7))
    model.configure_model()
    weights0 = {k: v.clone() for k, v in model.card["transformer"].state_dict().items()}
    quick_trainer(3).fit(model, Prompts(prompts=PROMPTS, batch_size=2))
    for k, v in model.card["transformer"].state_dict().items():
        assert torch.equal(weights0[k], v), k
    assert model.card.versions["transformer"] == 0
    assert model.optimizer_of("transformer").state == {}
    assert model.trainer.callback_metrics["train/kept_samples/transformer"].item() == 0


def test_parity_check_fails_loudly_when_recompute_uses_another_cfg_scale(monkeypatch):
    """Rollout at CFG 2, recompute at CFG 1: the check stops training before any update."""
    real = Rollout.logprob_gap
    monkeypatch.setattr(Rollout, "logprob_gap", lambda self, name=None: real(
        dataclasses.replace(self, sampler=FlowMatchSampler(num_steps=8, guidance_scale=1.0)), name))
    model = make(rollout_sampler=FlowMatchSampler(num_steps=8, guidance_scale=2.0))
    model.configure_model()
    weights0 = {k: v.clone() for k, v in model.card["transformer"].state_dict().items()}
    with pytest.raises(LogProbParityError, match="log-probability parity violated at iteration 0"):
        quick_trainer(2, callbacks=[LogProbParityCheck()]).fit(model, Prompts(prompts=PROMPTS, batch_size=2))
    assert all(torch.equal(weights0[k], v) for k, v in model.card["transformer"].state_dict().items())


class NaNReward(ColourAlignment):
    def __call__(self, media, prompts, context=None):
        out = super().__call__(media, prompts, context)
        return RewardOutput(out.total * float("nan"), {})


class WrongShapeReward(ColourAlignment):
    def __call__(self, media, prompts, context=None):
        return RewardOutput(super().__call__(media, prompts, context).total[:1], {})


@pytest.mark.parametrize("reward, message", [
    (NaNReward(), r"reward 'NaNReward': total is not finite for samples \[0, 1, 2, 3, 4, 5, 6, 7\]"),
    (WrongShapeReward(), r"reward 'WrongShapeReward': total has shape \(1,\), expected \(8,\)"),
])
def test_bad_reward_is_a_clear_error(reward, message):
    model = make(reward=reward)
    with pytest.raises(ValueError, match=message):
        quick_trainer(1).fit(model, Prompts(prompts=PROMPTS, batch_size=2))


def test_bad_options_and_empty_prompts():
    with pytest.raises(ValueError, match=r"num_samples_per_prompt=1 must be >= 2") as err:
        make(grpo=dict(num_samples_per_prompt=1, timestep_fraction=0.0))
    assert "grpo.timestep_fraction=0.0 must be in (0, 1]" in str(err.value)  # all problems in one message
    with pytest.raises(ValueError, match="the inline `prompts` list is empty"):
        Prompts(prompts=[])
    model = make()
    with pytest.raises(ValueError, match="flow_grpo: the batch holds no prompts"):
        model.training_step({"prompt": [], "index": torch.zeros(0, dtype=torch.long),
                             "group": torch.zeros(0, dtype=torch.long)}, 0)


def test_config_parses(tmp_path):
    cli = PosttrainCLI(args=["--config", "configs/flow_grpo.yaml", "--trainer.logger=false",
                             f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert isinstance(cli.model, FlowGRPO) and isinstance(cli.model.reward, SyntheticGenEvalReward)
    assert cli.model.grpo.num_samples_per_prompt >= 2 and cli.model.sampler.num_steps <= 10
    assert cli.model.rollout_sampler is cli.model.sampler  # train ≡ serve unless a config says otherwise
    assert any(isinstance(cb, LogProbParityCheck) for cb in cli.trainer.callbacks)
