"""DiffusionNFT end to end: real Trainer.fit on CPU with tiny presets of the real classes."""
import pytest
import torch
import yaml
from lightning.pytorch import Callback

from posttrain.datamodules.prompts import Prompts
from posttrain.lit.tools.config import PosttrainCLI
from posttrain.lit.base import RunArgs
from posttrain.lit.diffusion_nft import DiffusionNFT
from posttrain.modules.models.cards import Expert, ModelCard
from posttrain.modules.rl.grpo import GRPOArgs
from posttrain.modules.rewards.synthetic import ColourAlignment, SyntheticGenEvalReward
from posttrain.modules.rewards.base import ConstantReward, RewardOutput, score
from posttrain.modules.flow.samplers import FlowMatchSampler
from tests.conftest import TINY_WAN, adamw
from tests.helpers import assert_one_metric_scheme, quick_trainer

PROMPTS = ["a red circle moving left on a blue background", "a yellow square moving down on a magenta background"]
VAE = Expert(arch="wan_vae")
VIDEO = dict(run=RunArgs(frames=5, height=16, width=16))


pytestmark = pytest.mark.usefixtures("one_thread")


def make(lr: float = 1e-3, reward=None, **kwargs) -> DiffusionNFT:
    card = ModelCard({"text_encoder": Expert(arch="umt5"), "vae": VAE,
                      "transformer": Expert(arch="wan_t2v", preset=TINY_WAN, trainable=True, optimizer=adamw(lr))}, text_max_length=32)
    defaults = dict(grpo=GRPOArgs(num_samples_per_prompt=4), sampler=FlowMatchSampler(num_steps=8), **VIDEO)
    defaults.update(kwargs)
    return DiffusionNFT(card, reward=reward, **defaults)


def eval_reward(model) -> float:
    model.eval()
    return score(model.reward, model.generate(PROMPTS, seed=123), PROMPTS).total.mean().item()


def snapshot(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def same(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_diffusion_nft_raises_the_colour_reward_and_blends_old():
    torch.manual_seed(0)
    model = make()
    model.configure_model()
    before = eval_reward(model)
    initial = snapshot(model.card["transformer"])
    quick_trainer(30).fit(model, Prompts(prompts=PROMPTS, batch_size=2))
    after = eval_reward(model)
    print(f"diffusion_nft reward {before:.4f} -> {after:.4f}")
    assert after > before + 1e-2, (before, after)
    policy, old = snapshot(model.card["transformer"]), snapshot(model.card["transformer_old"])
    # `old` has its own version, moved by the decay-blend sync plan once per policy step; it trails the
    # policy (η = min(0.001·step, 0.5) > 0) but has left the initial weights; the reference never moves
    assert model.card.versions["transformer"] == 30 and model.card.versions["transformer_old"] == 30
    assert not same(old, policy) and not same(old, initial)
    assert same(snapshot(model.card["transformer_reference"]), initial)
    assert model.card.versions["transformer_reference"] == 0
    metrics = model.trainer.callback_metrics
    for name in ("train/reward", "train/reward_std", "train/loss/transformer", "train/kl/transformer",
                 "train/decay/transformer_old", "train/version/transformer_old"):
        assert name in metrics, name
    assert_one_metric_scheme(metrics, model.card)


@pytest.mark.slow
def test_shipped_settings_learn_against_a_zero_lr_control():
    """configs/diffusion_nft.yaml's NFT settings (β, KL, decay of ``old``, noise levels, group, prompts a step), on
    the tiny generator: after 20 iterations the reward of fixed-noise ODE samples is clearly above a control run that
    sees the same rollouts at learning rate 0 (which is what removing the update leaves)."""
    config = yaml.safe_load(open("configs/diffusion_nft.yaml"))
    init, batch_size = config["model"]["init_args"], config["data"]["init_args"]["batch_size"]
    settings = {k: init[k] for k in ("beta", "kl_beta", "decay_type", "num_timesteps")}
    after = {}
    for lr in (0.0, 1e-3):
        torch.manual_seed(0)
        model = make(lr, grpo=GRPOArgs(**init["grpo"]), **settings)
        quick_trainer(20).fit(model, Prompts(prompts=PROMPTS, batch_size=batch_size))
        after[lr] = eval_reward(model)
    print(f"diffusion_nft shipped settings: control {after[0.0]:.4f}, trained {after[1e-3]:.4f}")
    assert after[1e-3] > after[0.0] + 0.03, after


def test_decay_type_0_keeps_old_equal_to_the_policy():
    model = make(decay_type=0, kl_beta=0.0)
    quick_trainer(2).fit(model, Prompts(prompts=PROMPTS, batch_size=2))
    assert same(snapshot(model.card["transformer_old"]), snapshot(model.card["transformer"]))
    assert model.card.versions["transformer_old"] == 2 and "transformer_reference" not in model.card.models


def test_ema_follows_the_policy_steps_and_serves():
    """``ema_decay`` (the reference evaluates its EMA): ``transformer_ema`` starts as the policy and after each policy
    step moves to d·ema + (1-d)·policy; ``old`` trails on its own schedule, and ``generate`` samples the EMA."""
    torch.manual_seed(0)
    model = make(ema_decay=0.5)
    model.configure_model()
    assert model.serving_transformer == "transformer_ema"
    expected, seen = snapshot(model.card["transformer"]), []

    class AfterPolicySteps(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            if "transformer" in pl_module.stepped:  # before the versions callback bumps and syncs
                seen.append(snapshot(pl_module.card["transformer"]))

    quick_trainer(3, callbacks=[AfterPolicySteps()]).fit(model, Prompts(prompts=PROMPTS, batch_size=2))
    assert len(seen) == model.card.versions["transformer"] == model.card.versions["transformer_ema"] > 0
    for policy in seen:
        expected = {k: 0.5 * v + 0.5 * policy[k] for k, v in expected.items()}
    ema = snapshot(model.card["transformer_ema"])
    assert max((ema[k] - expected[k]).abs().max().item() for k in ema) < 1e-6
    assert not same(ema, seen[-1]) and not same(ema, snapshot(model.card["transformer_old"]))
    model.eval()
    served = model.generate(PROMPTS[:1], seed=5, latents_only=True)
    ema_weights = snapshot(model.card["transformer_ema"])
    model.card["transformer_ema"].load_state_dict(snapshot(model.card["transformer"]))
    assert not torch.allclose(served, model.generate(PROMPTS[:1], seed=5, latents_only=True))  # it was the EMA
    model.card["transformer_ema"].load_state_dict(ema_weights)
    assert torch.equal(served, model.generate(PROMPTS[:1], seed=5, latents_only=True))


def test_constant_reward_changes_nothing():
    model = make(reward=ConstantReward(0.3))
    model.configure_model()
    initial = snapshot(model.card["transformer"])
    quick_trainer(3).fit(model, Prompts(prompts=PROMPTS, batch_size=2))
    assert same(snapshot(model.card["transformer"]), initial)
    assert same(snapshot(model.card["transformer_old"]), initial)
    assert model.card.versions["transformer"] == 0 and model.card.versions["transformer_old"] == 0
    assert model.optimizer_of("transformer").state == {}


class NaNReward(ColourAlignment):
    def __call__(self, media, prompts, context=None):
        return RewardOutput(torch.full((len(prompts),), float("nan")), {})


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match=r"num_samples_per_prompt=1 must be >= 2") as err:
        make(grpo=GRPOArgs(num_samples_per_prompt=1), beta=0.0)
    assert "beta=0.0 must be > 0" in str(err.value)
    with pytest.raises(ValueError, match=r"reward 'NaNReward': total is not finite"):
        quick_trainer(1).fit(make(reward=NaNReward()), Prompts(prompts=PROMPTS, batch_size=2))
    with pytest.raises(ValueError, match=r"ema_decay=1.0 must be in \(0, 1\) \(the reference's 0.9"):
        make(ema_decay=1.0)
    with pytest.raises(ValueError, match="diffusion_nft: the batch holds no prompts"):
        make().training_step({"prompt": [], "index": torch.zeros(0, dtype=torch.long),
                              "group": torch.zeros(0, dtype=torch.long)}, 0)


def test_config_parses(tmp_path):
    cli = PosttrainCLI(args=["--config", "configs/diffusion_nft.yaml", "--trainer.logger=false",
                             f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert isinstance(cli.model, DiffusionNFT) and isinstance(cli.model.reward, SyntheticGenEvalReward)
    assert cli.model.decay_type in (0, 1, 2)
