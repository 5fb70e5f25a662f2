"""RL losses and advantages on tiny hand-made tensors; expected values derived in the docstrings."""
import math

import pytest
import torch

from posttrain.modules.rl.advantages import group_advantages
from posttrain.modules.rl.losses import nft_loss, nft_old_decay, nft_reward_weight, ppo_clip_loss, sde_kl


def test_ppo_clip_loss_by_hand():
    """ε = 0.2. Sample 0: lp - lp_old = log 1.5, A = 1 → ratio 1.5, max(-1.5, -1.2) = -1.2 (clipped).
    Sample 1: ratio 0.5, A = 1 → max(-0.5, -0.8) = -0.5 (unclipped: a drop is not clipped for A > 0).
    Sample 2: ratio 0.5, A = -2 → max(1.0, 1.6) = 1.6 (clipped). Sample 3: ratio 1, A = 3 → -3.
    clip_frac = 3/4 (|ratio-1| > ε for samples 0-2); ratio_mean = (1.5+0.5+0.5+1)/4 = 0.875."""
    old = torch.zeros(4)
    lp = torch.tensor([math.log(1.5), math.log(0.5), math.log(0.5), 0.0])
    adv = torch.tensor([1.0, 1.0, -2.0, 3.0])
    per_sample, m = ppo_clip_loss(lp, old, adv, 0.2)
    torch.testing.assert_close(per_sample, torch.tensor([-1.2, -0.5, 1.6, -3.0]))
    assert m["clip_frac"].item() == pytest.approx(0.75)
    assert m["ratio_mean"].item() == pytest.approx(0.875)


def test_ppo_clip_loss_gradient_at_ratio_one():
    """At ratio 1, d/dlp of max(-A·r, -A·clip(r)) = -A·r = -A (the policy gradient), none to lp_old."""
    lp = torch.zeros(3, requires_grad=True)
    old = torch.zeros(3, requires_grad=True)
    adv = torch.tensor([2.0, -1.0, 0.0])
    per_sample, _ = ppo_clip_loss(lp, old, adv, 1e-3)
    per_sample.sum().backward()
    torch.testing.assert_close(lp.grad, -adv)
    assert old.grad is None or torch.all(old.grad == 0)


def test_sde_kl_by_hand_and_carries_gradient():
    """mean - ref = [[1, 1], [2, 0]] per element, std_dt = [1, 2]:
    sample 0: mean(1, 1)/(2·1) = 0.5; sample 1: mean(4, 0)/(2·4) = 0.25. d/dmean = (mean-ref)/(n·std_dt²)."""
    mean = torch.tensor([[1.0, 1.0], [2.0, 0.0]], requires_grad=True)
    ref = torch.zeros(2, 2)
    kl = sde_kl(mean, ref, torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(kl, torch.tensor([0.5, 0.25]))
    kl.sum().backward()
    torch.testing.assert_close(mean.grad, torch.tensor([[0.5, 0.5], [0.25, 0.0]]))


def test_nft_reward_weight():
    """r = clip(clip(A, ±5)/5/2 + 0.5, 0, 1): A = -10 → 0, -5 → 0, 0 → 0.5, 2.5 → 0.75, 7 → 1."""
    r = nft_reward_weight(torch.tensor([-10.0, -5.0, 0.0, 2.5, 7.0]))
    torch.testing.assert_close(r, torch.tensor([0.0, 0.0, 0.5, 0.75, 1.0]))


def test_nft_loss_by_hand():
    """One sample, two elements, σ = 0.5, β = 1, x_t = 0, x0 = 0, v_θ = [2, 0], v_old = [0, 0]:
    v+ = v_θ = [2, 0] → x0+ - x0 = [-1, 0]: L+ = mean(1, 0)/mean(1, 0) = 0.5/0.5 = 1.
    v- = 2·v_old - v_θ = [-2, 0] → x0- - x0 = [1, 0]: L- = 1.
    r = 0.75: loss = 5·(0.75·1 + 0.25·1) = 5. With v_ref = [1, 1], kl_β = 0.1: + 0.1·mean(1, 1) = 5.1.
    Gradient (no KL): d/dv_θ of 5·(r·|e+|²/n/w+ + (1-r)·|e-|²/n/w-), e± = ∓σ·v_θ on element 0:
    5·(0.75·2·(-1)·(-0.5)/2/0.5 + 0.25·2·1·0.5/2/0.5) = 5·(0.75 + 0.25) = 5 on element 0, 0 on element 1."""
    v_theta = torch.tensor([[2.0, 0.0]], requires_grad=True)
    zeros = torch.zeros(1, 2)
    per_sample, m = nft_loss(v_theta, zeros, zeros, zeros, torch.tensor([0.5]), torch.tensor([0.75]), beta=1.0)
    torch.testing.assert_close(per_sample, torch.tensor([5.0]))
    per_sample.sum().backward()
    torch.testing.assert_close(v_theta.grad, torch.tensor([[5.0, 0.0]]))
    with_kl, m = nft_loss(v_theta, zeros, zeros, zeros, torch.tensor([0.5]), torch.tensor([0.75]), beta=1.0,
                          v_ref=torch.ones(1, 2), kl_beta=0.1)
    torch.testing.assert_close(with_kl, torch.tensor([5.1]))
    assert m["kl"].item() == pytest.approx(1.0)


def test_nft_loss_symmetric_at_old_policy():
    """At v_θ = v_old and r = ½ the positive and negative terms' gradients cancel (β = 1)."""
    g = torch.Generator().manual_seed(0)
    v_old = torch.randn(2, 3, 4, generator=g)
    v_theta = v_old.clone().requires_grad_(True)
    x_t, x0 = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    per_sample, _ = nft_loss(v_theta, v_old, x_t, x0, torch.tensor([0.3, 0.7]), torch.full((2,), 0.5))
    per_sample.sum().backward()
    assert v_theta.grad.abs().max() < 1e-5


def test_nft_old_decay_types():
    assert [nft_old_decay(0, s) for s in (0, 10, 1000)] == [0.0, 0.0, 0.0]
    assert [nft_old_decay(1, s) for s in (0, 100, 1000)] == pytest.approx([0.0, 0.1, 0.5])
    assert [nft_old_decay(2, s) for s in (10, 75, 175, 10_000)] == pytest.approx([0.0, 0.0, 0.75, 0.999])
    with pytest.raises(ValueError, match="decay_type=3"):
        nft_old_decay(3, 0)


def test_group_advantages_by_hand():
    """Group 0: r = [1, 3] → mean 2, std 1 → A = ±1/(1+1e-4). Group 1: r = [0, 0, 6] → mean 2,
    std sqrt(8) → A = [-2, -2, 4]/(2.828+1e-4). Group 2: constant → exactly 0."""
    r = torch.tensor([1.0, 3.0, 0.0, 0.0, 6.0, 0.7, 0.7])
    ids = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    adv = group_advantages(r, ids)
    s = math.sqrt(8) + 1e-4
    expected = torch.tensor([-1 / 1.0001, 1 / 1.0001, -2 / s, -2 / s, 4 / s, 0.0, 0.0])
    torch.testing.assert_close(adv, expected)
    assert torch.all(adv[5:] == 0)


def test_group_advantages_global_std_and_clip():
    """Global std of [0, 0, 0, 10] is sqrt(18.75) = 4.33; one group [0, 10] → ±5/4.33 = ±1.155;
    the other [0, 0] constant → 0. clip=1 clips ±1.155 to ±1."""
    r = torch.tensor([0.0, 10.0, 0.0, 0.0])
    ids = torch.tensor([0, 0, 1, 1])
    adv = group_advantages(r, ids, std="global")
    s = math.sqrt(18.75) + 1e-4
    torch.testing.assert_close(adv, torch.tensor([-5 / s, 5 / s, 0.0, 0.0]))
    torch.testing.assert_close(group_advantages(r, ids, std="global", clip=1.0), torch.tensor([-1.0, 1.0, 0.0, 0.0]))


def test_group_advantages_constant_reward_is_exactly_zero():
    """A float residue of the mean (0.1·3/3 ≠ 0.1 in float32) must not become a large advantage."""
    r = torch.full((6,), 0.1)
    assert torch.all(group_advantages(r, torch.tensor([0, 0, 0, 1, 1, 1])) == 0)
