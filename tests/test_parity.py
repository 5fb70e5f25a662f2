"""The C2 identity through the rollout helpers, and C2Check's hook, options and failure modes."""
import pytest
import torch

from posttrain.callbacks.parity import C2Check, C2ViolationError
from posttrain.modules.generators import GeneratorStage, VideoSize
from posttrain.modules.rollout import c2_gap, mean_metrics, ppo_step_losses, recompute_log_probs, rollout
from posttrain.modules.samplers import FlowMatchSampler
from tests.conftest import wan_card


@pytest.fixture(scope="module")
def rolled():
    card = wan_card()
    card.build()
    stage = GeneratorStage(card)
    sampler = FlowMatchSampler(num_steps=4, guidance_scale=2.0)
    cond, uncond = stage.conditioning(["a red circle moving left on a blue background"] * 2, 2.0)
    traj = rollout(stage, sampler, cond, stage.latent_shape(VideoSize(5, 16, 16)), torch.Generator().manual_seed(0),
                   uncond=uncond, guidance_scale=2.0)
    return stage, sampler, cond, uncond, traj


def test_c2_identity_at_rollout_weights(rolled):
    stage, sampler, cond, uncond, traj = rolled
    assert traj.log_probs.shape == (4, 2) and traj.xs.shape[:2] == (5, 2)
    gap = c2_gap(stage, sampler, traj, cond, uncond, guidance_scale=2.0)
    assert gap < 1e-5
    # a different CFG scale at recompute is a different policy: the gap is large
    assert c2_gap(stage, sampler, traj, cond, uncond, guidance_scale=1.0) > 1e-3
    torch.testing.assert_close(recompute_log_probs(stage, sampler, traj, cond, uncond, 2.0),
                               traj.log_probs, atol=1e-5, rtol=0)


def test_ppo_ratio_is_one_and_kl_zero_at_rollout_weights(rolled):
    """At the rollout's weights: ratio 1, nothing clipped, KL to an identical reference 0 — and the
    loss still has a gradient (the policy gradient -A·∇log p, plus a KL that carries gradient)."""
    stage, sampler, cond, uncond, traj = rolled
    metrics = {}
    parts = ppo_step_losses(stage, sampler, traj, [0, 2], cond, torch.tensor([1.0, -1.0]), 1e-3, 0.1, uncond, 2.0,
                            reference="transformer", metrics=metrics)
    assert len(parts) == 2 and not metrics  # nothing is computed before it is asked for
    for part in parts:  # per-step backward: one step's graph at a time
        part().backward()
    m = mean_metrics(metrics)
    assert abs(m["ratio_mean"].item() - 1) < 1e-5 and m["clip_frac"].item() == 0.0 and m["kl"].item() < 1e-10
    transformer = stage.card["transformer"]
    grads = [p.grad for p in transformer.parameters() if p.grad is not None]
    assert grads and sum(g.abs().sum() for g in grads) > 0
    transformer.zero_grad(set_to_none=True)


def test_per_step_backward_equals_one_backward_of_the_sum(rolled):
    """Backing up each step's loss as it comes (activation memory of one step) gives the gradients of
    one backward of the summed loss."""
    stage, sampler, cond, uncond, traj = rolled
    transformer = stage.card["transformer"]
    args = (stage, sampler, traj, [0, 1, 3], cond, torch.tensor([0.7, -1.2]), 1e-3, 0.1, uncond, 2.0)
    for part in ppo_step_losses(*args, reference="transformer"):
        part().backward()
    per_step = [p.grad.clone() for p in transformer.parameters()]
    transformer.zero_grad(set_to_none=True)
    sum(part() for part in ppo_step_losses(*args, reference="transformer")).backward()
    for a, p in zip(per_step, transformer.parameters()):
        torch.testing.assert_close(a, p.grad, atol=1e-6, rtol=1e-5)
    transformer.zero_grad(set_to_none=True)


def test_micro_batches_give_the_gradients_of_the_whole_batch(rolled):
    """``micro_batch=1``: each step's loss in chunks of one row (activation memory of one row), backed up one
    after another, gives the gradients of the whole batch's per-step backward, and logs the same losses."""
    stage, sampler, cond, uncond, traj = rolled
    transformer = stage.card["transformer"]
    args = (stage, sampler, traj, [0, 1, 3], cond, torch.tensor([0.7, -1.2]), 1e-3, 0.1, uncond, 2.0)
    whole_metrics, micro_metrics = {}, {}
    for part in ppo_step_losses(*args, reference="transformer", metrics=whole_metrics):
        part().backward()
    whole = [p.grad.clone() for p in transformer.parameters()]
    transformer.zero_grad(set_to_none=True)
    parts = ppo_step_losses(*args, reference="transformer", metrics=micro_metrics, micro_batch=1)
    assert len(parts) == 3 * 2
    for part in parts:
        part().backward()
    for a, p in zip(whole, transformer.parameters()):
        torch.testing.assert_close(a, p.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(mean_metrics(micro_metrics)["loss"], mean_metrics(whole_metrics)["loss"])
    transformer.zero_grad(set_to_none=True)


class FakeTrainer:
    global_step = 0


class FakeModule:
    def __init__(self):
        self.logged = {}

    def log(self, name, value, **kwargs):
        self.logged[name] = value


def test_c2_check_logs_passes_and_raises():
    check, module = C2Check(tolerance=1e-5), FakeModule()
    check.on_train_batch_start(FakeTrainer(), module, None, 0)
    check.on_rollout_captured(FakeTrainer(), module, lambda: torch.tensor(3e-7))
    assert module.logged["train/c2_max_abs_dlogp"] == pytest.approx(3e-7) and check.checks == 1
    check.on_train_batch_end(FakeTrainer(), module, None, None, 0)
    with pytest.raises(C2ViolationError, match=r"C2 identity violated at iteration 0: .* = 0.5 > tolerance 1e-05"):
        check.on_rollout_captured(FakeTrainer(), module, lambda: torch.tensor(0.5))
    with pytest.raises(C2ViolationError):
        check.on_rollout_captured(FakeTrainer(), module, lambda: torch.tensor(float("nan")))
    with pytest.warns(UserWarning, match="C2 identity violated"):
        C2Check(on_violation="warn").on_rollout_captured(FakeTrainer(), module, lambda: torch.tensor(0.5))


def test_c2_check_every_n_and_methods_without_rollouts():
    check, module = C2Check(every_n_iterations=2), FakeModule()
    trainer = FakeTrainer()
    trainer.global_step = 1
    probed = []
    check.on_rollout_captured(trainer, module, lambda: probed.append(1) or torch.tensor(0.0))
    assert probed == []  # iteration 1 is not checked
    check.on_train_batch_start(trainer, module, None, 0)
    with pytest.raises(RuntimeError, match="reported no rollout"):
        check.on_train_batch_end(trainer, module, None, None, 0)
    with pytest.raises(ValueError, match="every_n_iterations=0"):
        C2Check(every_n_iterations=0)
