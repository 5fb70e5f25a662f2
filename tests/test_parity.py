"""Log-probability parity through the rollout object (recomputed log p == captured at the rollout's weights), and
LogProbParityCheck's hook, options and failure modes."""
import dataclasses

import pytest
import torch

from posttrain.callbacks.parity import LogProbParityCheck, LogProbParityError
from posttrain.modules.models.generators import GeneratorStage, VideoSize
from posttrain.modules.rl.rollout import Rollout, mean_metrics
from posttrain.modules.flow.samplers import FlowMatchSampler
from tests.conftest import wan_card


@pytest.fixture(scope="module")
def rolled() -> Rollout:
    card = wan_card()
    card.build()
    stage = GeneratorStage(card)
    sampler = FlowMatchSampler(num_steps=4, guidance_scale=2.0)
    cond, uncond = stage.conditioning(["a red circle moving left on a blue background"] * 2, sampler.guidance_scale)
    return Rollout.sample(stage, sampler, cond, uncond, stage.latent_shape(VideoSize(5, 16, 16)),
                          torch.Generator().manual_seed(0))


def test_logprob_parity_at_rollout_weights(rolled):
    traj = rolled.traj
    assert traj.log_probs.shape == (4, 2) and traj.xs.shape[:2] == (5, 2)
    assert rolled.logprob_gap() < 1e-5
    # a different CFG scale at recompute is a different policy: the gap is large
    other = dataclasses.replace(rolled, sampler=FlowMatchSampler(num_steps=4, guidance_scale=1.0))
    assert other.logprob_gap() > 1e-3
    torch.testing.assert_close(rolled.recompute_log_probs(), traj.log_probs, atol=1e-5, rtol=0)


def test_selected_rows_recompute_their_own_log_probs(rolled):
    """``select`` keeps the rows it names, in its order: their conditioning, stored log p and latents; log-probability
    parity holds on the selection, and a selection of a selection names the original rows."""
    swapped = rolled.select(torch.tensor([1, 0]))
    assert torch.equal(swapped.latents, rolled.latents.flip(0))
    torch.testing.assert_close(swapped.recompute_log_probs(), rolled.traj.log_probs.flip(1), atol=1e-5, rtol=0)
    assert swapped.logprob_gap() < 1e-5
    again = swapped.select(torch.tensor([0]))
    assert again.rows.tolist() == [1] and torch.equal(again.cond["encoder_hidden_states"],
                                                      rolled.cond["encoder_hidden_states"][1:])


def test_ppo_ratio_is_one_and_kl_zero_at_rollout_weights(rolled):
    """At the rollout's weights: ratio 1, nothing clipped, KL to an identical reference 0 — and the
    loss still has a gradient (the policy gradient -A·∇log p, plus a KL that carries gradient)."""
    metrics = {}
    parts = rolled.step_losses([0, 2], torch.tensor([1.0, -1.0]), 1e-3, 0.1, reference="transformer", metrics=metrics)
    assert len(parts) == 2 and not metrics  # nothing is computed before it is asked for
    for part in parts:  # per-step backward: one step's graph at a time
        part().backward()
    m = mean_metrics(metrics)
    assert abs(m["ppo_ratio_mean"].item() - 1) < 1e-5 and m["clip_frac"].item() == 0.0 and m["kl"].item() < 1e-10
    transformer = rolled.stage.card["transformer"]
    grads = [p.grad for p in transformer.parameters() if p.grad is not None]
    assert grads and sum(g.abs().sum() for g in grads) > 0
    transformer.zero_grad(set_to_none=True)


def test_per_step_backward_equals_one_backward_of_the_sum(rolled):
    """Backing up each step's loss as it comes (activation memory of one step) gives the gradients of
    one backward of the summed loss."""
    transformer = rolled.stage.card["transformer"]
    args = ([0, 1, 3], torch.tensor([0.7, -1.2]), 1e-3, 0.1)
    for part in rolled.step_losses(*args, reference="transformer"):
        part().backward()
    per_step = [p.grad.clone() for p in transformer.parameters()]
    transformer.zero_grad(set_to_none=True)
    sum(part() for part in rolled.step_losses(*args, reference="transformer")).backward()
    for a, p in zip(per_step, transformer.parameters()):
        torch.testing.assert_close(a, p.grad, atol=1e-6, rtol=1e-5)
    transformer.zero_grad(set_to_none=True)


def test_micro_batches_give_the_gradients_of_the_whole_batch(rolled):
    """``micro_batch=1``: each step's loss in chunks of one row (activation memory of one row), backed up one
    after another, gives the gradients of the whole batch's per-step backward, and logs the same losses."""
    transformer = rolled.stage.card["transformer"]
    args = ([0, 1, 3], torch.tensor([0.7, -1.2]), 1e-3, 0.1)
    whole_metrics, micro_metrics = {}, {}
    for part in rolled.step_losses(*args, reference="transformer", metrics=whole_metrics):
        part().backward()
    whole = [p.grad.clone() for p in transformer.parameters()]
    transformer.zero_grad(set_to_none=True)
    parts = rolled.step_losses(*args, reference="transformer", metrics=micro_metrics, micro_batch=1)
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


def test_parity_check_logs_passes_and_raises():
    check, module = LogProbParityCheck(tolerance=1e-5), FakeModule()
    check.on_train_batch_start(FakeTrainer(), module, None, 0)
    check.on_rollout_captured(FakeTrainer(), module, lambda: torch.tensor(3e-7))
    assert module.logged["train/logprob_parity_gap"] == pytest.approx(3e-7) and check.checks == 1
    check.on_train_batch_end(FakeTrainer(), module, None, None, 0)
    with pytest.raises(LogProbParityError,
                       match=r"log-probability parity violated at iteration 0: .* = 0.5 > tolerance 1e-05"):
        check.on_rollout_captured(FakeTrainer(), module, lambda: torch.tensor(0.5))
    with pytest.raises(LogProbParityError):
        check.on_rollout_captured(FakeTrainer(), module, lambda: torch.tensor(float("nan")))
    with pytest.warns(UserWarning, match="log-probability parity violated"):
        LogProbParityCheck(on_violation="warn").on_rollout_captured(FakeTrainer(), module, lambda: torch.tensor(0.5))


def test_parity_check_every_n_and_methods_without_rollouts():
    check, module = LogProbParityCheck(every_n_iterations=2), FakeModule()
    trainer = FakeTrainer()
    trainer.global_step = 1
    probed = []
    check.on_rollout_captured(trainer, module, lambda: probed.append(1) or torch.tensor(0.0))
    assert probed == []  # iteration 1 is not checked
    check.on_train_batch_start(trainer, module, None, 0)
    with pytest.raises(RuntimeError, match="reported no rollout"):
        check.on_train_batch_end(trainer, module, None, None, 0)
    with pytest.raises(ValueError, match="every_n_iterations=0"):
        LogProbParityCheck(every_n_iterations=0)


@pytest.mark.slow
def test_the_former_name_c2check_still_resolves_to_the_parity_check(tmp_path):
    """Configs written before the rename name ``C2Check`` (short, or by its full path): both still build the parity
    check, with their options."""
    import os

    import yaml

    from posttrain.callbacks import parity
    from posttrain.lit.tools.config import PosttrainCLI

    assert issubclass(parity.C2Check, LogProbParityCheck) and parity.C2ViolationError is LogProbParityError
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    old = tmp_path / "old_names.yaml"
    old.write_text(yaml.safe_dump({"trainer": {"logger": False, "callbacks": [
        {"class_path": "C2Check", "init_args": {"every_n_iterations": 3}},
        {"class_path": "posttrain.callbacks.parity.C2Check", "init_args": {"tolerance": 1e-3}}]}}))
    cli = PosttrainCLI(args=["--config", os.path.join(root, "configs", "flow_grpo.yaml"), "--config", str(old)],
                       run=False)
    checks = [c for c in cli.trainer.callbacks if isinstance(c, LogProbParityCheck)]
    assert [(c.every, c.tolerance) for c in checks] == [(3, 1e-5), (1, 1e-3)]
