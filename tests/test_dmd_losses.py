"""DMD2 losses on tiny hand-made tensors; expected values derived in the docstrings."""
import pytest
import torch

from posttrain.modules.distill.losses import dmd_generator_loss

from posttrain.modules.flow.losses import flow_matching_loss, noised, x0_from_velocity


def video(*values: float) -> torch.Tensor:
    """(B, C, F, H, W) = (B, 1, 1, 1, 2) from 2·B numbers."""
    return torch.tensor(values, dtype=torch.float32).view(-1, 1, 1, 1, 2)


def test_dmd_generator_loss_by_hand():
    """g = 3. Sample 0: x̂0 = [1, 3]; teacher uncond [-3, 1], cond [-2, 1] → real = -3 + 3·1 = 0, 1 + 3·0 = 1:
    real = [0, 1]. Critic fake = [2, 2]. Normalizer mean|x̂0 - real| = mean(1, 2) = 1.5; grad = (fake - real)/1.5
    = [2, 1]/1.5 = [4/3, 2/3]. L = 0.5·mean(grad²) = 0.5·(16/9 + 4/9)/2 = 5/9; dL/dx̂0 = grad/2 = [2/3, 1/3].
    Sample 1: x̂0 = real = fake = [5, 5] → 0/0 = nan, nan_to_num → grad 0, L = 0, no gradient.
    Metrics: mean|grad| over all 4 elements = (4/3 + 2/3)/4 = 0.5; mean normalizer = (1.5 + 0)/2 = 0.75."""
    x0 = video(1, 3, 5, 5).requires_grad_(True)
    uncond, cond, fake = video(-3, 1, 5, 5), video(-2, 1, 5, 5), video(2, 2, 5, 5)
    per_sample, m = dmd_generator_loss(x0, cond, fake, real_x0_uncond=uncond, guidance_scale=3.0)
    torch.testing.assert_close(per_sample, torch.tensor([5 / 9, 0.0]))
    per_sample.sum().backward()
    torch.testing.assert_close(x0.grad, video(2 / 3, 1 / 3, 0, 0))
    assert m["dmd_grad_abs"].item() == pytest.approx(0.5)
    assert m["dmd_normalizer"].item() == pytest.approx(0.75)


def test_dmd_normalizer_is_per_sample():
    """Sample 1 is sample 0 with every distance ×10: x̂0 = [10, 30], real = [0, 10], fake = [20, 20]. Its grad is
    [20, 10]/15 = sample 0's [4/3, 2/3]: the same loss 5/9, whatever the scale (the normalizer is per sample,
    not over the batch). No CFG: real is the conditional x0 itself."""
    x0 = video(1, 3, 10, 30)
    per_sample, _ = dmd_generator_loss(x0, video(0, 1, 0, 10), video(2, 2, 20, 20))
    torch.testing.assert_close(per_sample, torch.tensor([5 / 9, 5 / 9]))


def test_dmd_scores_get_no_gradient():
    """Teacher and critic outputs are constants (sg): only x̂0 receives gradient."""
    x0 = video(1, 3).requires_grad_(True)
    cond, uncond, fake = (video(*v).requires_grad_(True) for v in [(-2, 1), (-3, 1), (2, 2)])
    per_sample, _ = dmd_generator_loss(x0, cond, fake, real_x0_uncond=uncond, guidance_scale=3.0)
    per_sample.sum().backward()
    assert x0.grad is not None and x0.grad.abs().sum() > 0
    assert cond.grad is None and uncond.grad is None and fake.grad is None


def test_dmd_guidance_without_uncond_is_refused():
    with pytest.raises(ValueError, match="guidance_scale=4.5"):
        dmd_generator_loss(video(1, 3), video(0, 1), video(2, 2), guidance_scale=4.5)


def test_cfg_in_x0_space_equals_cfg_on_velocity():
    """σ = 0.5, x_σ = [1, 1], v_u = [0, 2], v_c = [2, 2], g = 3: v = 0 + 3·2, 2 + 0 = [6, 2], x0 = 1 - 0.5·v
    = [-2, 0]. Per branch: x0_u = [1, 0], x0_c = [0, 0] → 1 + 3·(0 - 1) = -2, 0: the same."""
    x_t, sigma = video(1, 1), torch.tensor([0.5])
    v_u, v_c = video(0, 2), video(2, 2)
    x0_u, x0_c = x0_from_velocity(x_t, v_u, sigma), x0_from_velocity(x_t, v_c, sigma)
    torch.testing.assert_close(x0_u + 3 * (x0_c - x0_u), video(-2, 0))
    torch.testing.assert_close(x0_from_velocity(x_t, v_u + 3 * (v_c - v_u), sigma), video(-2, 0))


def test_critic_flow_matching_on_detached_samples():
    """The critic regresses v toward ε - sg(x̂0) at x_σ of the detached sample: x̂0 = [1, 3], ε = [0, 1],
    σ = 0.5 → x_σ = [0.5, 2], target ε - x̂0 = [-1, -2]; a critic velocity [0, 0] scores mean(1, 4) = 2.5, and
    the student gets no gradient from it."""
    x0 = video(1, 3).requires_grad_(True)
    eps, sigma = video(0, 1), torch.tensor([0.5])
    sample = x0.detach()
    torch.testing.assert_close(noised(sample, eps, sigma), video(0.5, 2))
    v_fake = torch.zeros(1, 1, 1, 1, 2, requires_grad=True)
    per_sample, _ = flow_matching_loss(v_fake, sample, eps)
    torch.testing.assert_close(per_sample, torch.tensor([2.5]))
    per_sample.sum().backward()
    assert x0.grad is None and v_fake.grad is not None
