"""The one sampler: σ schedules, the Flow-GRPO SDE step and its log-probability, the C2 identity."""
from __future__ import annotations

import math

import pytest
import torch

from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from posttrain.modules.conditioning import Conditioning
from posttrain.modules.generators import ADAPTERS
from posttrain.modules.samplers import (
    FlowMatchSampler, gaussian_log_prob, guided, ml_velocity, sde_mean, sde_std, sde_step, shift_sigmas,
)


def velocity_of(model):
    """Wan T2V's velocity function over a raw (B, L, D) text tensor."""
    return lambda x, t, c: ADAPTERS["wan_t2v"].velocity(model, x, t, Conditioning(encoder_hidden_states=c))


def test_schedule_is_the_diffusers_schedulers():
    """σ and timesteps are what FlowMatchEulerDiscreteScheduler(shift=3).set_timesteps(4) gives — σ_i =
    shift(linspace(1, σ_min, 4)) then 0 with σ_min = shift(1/1000), timesteps 1000·σ — not
    shift(linspace(1, 0, 5)), which differs by up to 0.13 at the last step (what WanPipeline would not
    reproduce)."""
    assert shift_sigmas(torch.tensor(0.5), 3.0).item() == pytest.approx(0.75)
    schedule = FlowMatchSampler(num_steps=4).schedule()
    reference = FlowMatchEulerDiscreteScheduler(shift=3.0)
    reference.set_timesteps(4)
    assert torch.equal(schedule.sigmas, reference.sigmas) and torch.equal(schedule.timesteps, reference.timesteps)
    assert schedule.sigmas[0] == 1.0 and schedule.sigmas[-1] == 0.0 and torch.all(schedule.sigmas.diff() < 0)
    expected = shift_sigmas(torch.linspace(1.0, shift_sigmas(torch.tensor(1 / 1000), 3.0).item(), 4), 3.0)
    torch.testing.assert_close(schedule.sigmas[:-1], expected)
    old = shift_sigmas(torch.linspace(1.0, 0.0, 5), 3.0)
    assert (schedule.sigmas - old).abs().max() > 0.1


def test_euler_step_is_the_schedulers_step(wan):
    """The sampler's ODE step for the Euler scheduler equals ``scheduler.step`` exactly."""
    sampler = FlowMatchSampler(num_steps=3, scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0))
    fn = velocity_of(wan)
    noise = torch.randn(1, 16, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    cond = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1))
    reference = FlowMatchEulerDiscreteScheduler(shift=5.0)
    reference.set_timesteps(3)
    x = noise
    with torch.no_grad():
        ours = sampler.sample(fn, noise, cond).latents
        for t in reference.timesteps:
            x = reference.step(fn(x, t.expand(1), cond).float(), t, x, return_dict=False)[0]
    assert torch.equal(ours, x)


def test_another_flow_scheduler_serves_but_does_not_roll_out(wan):
    """UniPC (as Wan ships it) drives ODE serving through its own ``step``; an SDE rollout needs Euler;
    a scheduler that is not flow matching is refused at construction."""
    unipc = UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction")
    sampler = FlowMatchSampler(num_steps=4, scheduler=unipc)
    fn = velocity_of(wan)
    noise = torch.randn(1, 16, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    cond = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = sampler.sample(fn, noise, cond).latents
        b = sampler.sample(fn, noise, cond).latents  # a fresh scheduler copy per call: same result
        euler = FlowMatchSampler(num_steps=4).sample(fn, noise, cond).latents
    assert torch.equal(a, b) and not torch.allclose(a, euler)
    with pytest.raises(ValueError, match="SDE rollouts need FlowMatchEulerDiscreteScheduler"):
        sampler.sample(fn, noise, cond, sde=True)
    with pytest.raises(ValueError, match="not a flow-matching scheduler"):
        FlowMatchSampler(scheduler=DDIMScheduler())


def test_sde_log_prob_is_the_gaussian_density():
    """x_next ~ N(mean, (std·sqrt(-dt))²) per element; log p is the mean over non-batch dims.

    With σ = 0.5, σ_next = 0.25, a = 0.7: std = 0.7·sqrt(0.5/0.5) = 0.7, dt = -0.25,
    mean = x·(1 + 0.49·(-0.25)/1) + v·(1 + 0.49·0.5/1)·(-0.25) = 0.8775·x - 0.31125·v,
    scale = 0.7·0.5 = 0.35; compare with torch.distributions.Normal.
    """
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 4, generator=g)
    step = sde_step(x, v, torch.tensor(0.5), torch.tensor(0.25), noise_level=0.7, sigma_cap=0.9, generator=g)
    assert sde_std(torch.tensor(0.5), 0.7, 0.9).item() == pytest.approx(0.7)
    torch.testing.assert_close(step.mean, 0.8775 * x - 0.31125 * v)
    expected = torch.distributions.Normal(step.mean, 0.35).log_prob(step.x_next).mean(dim=(1, 2))
    torch.testing.assert_close(step.log_prob, expected)


def test_sde_std_caps_sigma_one():
    """At σ = 1 the denominator 1-σ uses the first σ below 1 (σ_cap = 0.8: std = 0.7·sqrt(1/0.2))."""
    assert sde_std(torch.tensor(1.0), 0.7, 0.8).item() == pytest.approx(0.7 * math.sqrt(5.0))


def test_ml_velocity_lands_the_mean_on_x_next():
    """mean(v*) = x_next exactly, and v* differs from the velocity that produced a noisy x_next."""
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    sigma, sigma_next = torch.tensor(0.6), torch.tensor(0.4)
    step = sde_step(x, v, sigma, sigma_next, 0.7, 0.9, generator=g)
    v_star = ml_velocity(x, step.x_next, sigma, sigma_next, 0.7, 0.9)
    std = sde_std(sigma, 0.7, 0.9)
    torch.testing.assert_close(sde_mean(x, v_star, sigma, sigma_next, std), step.x_next, atol=1e-5, rtol=1e-5)
    assert (v_star - v).abs().max() > 1e-2


def test_log_prob_gradient_points_to_ml_velocity():
    """d log p / d v is zero at v = v*, and moving v toward v* raises log p."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 6, generator=g)
    x_next = torch.randn(1, 6, generator=g)
    s, sn = torch.tensor(0.7), torch.tensor(0.5)
    v_star = ml_velocity(x, x_next, s, sn, 0.7, 0.9)
    v = torch.zeros(1, 6, requires_grad=True)
    lp = sde_step(x, v, s, sn, 0.7, 0.9, x_next=x_next).log_prob.sum()
    lp.backward()
    step = v.detach() + 1e-2 * v.grad
    assert (step - v_star).norm() < (v.detach() - v_star).norm()
    vs = v_star.clone().requires_grad_(True)
    sde_step(x, vs, s, sn, 0.7, 0.9, x_next=x_next).log_prob.sum().backward()
    assert vs.grad.abs().max() < 1e-4


def test_gaussian_log_prob_matches_closed_form():
    """One element, x_next = mean + scale: log p = -1/2 - log(scale) - 1/2·log 2π."""
    lp = gaussian_log_prob(torch.tensor([[1.5]]), torch.tensor([[1.0]]), torch.tensor(0.5))
    assert lp.item() == pytest.approx(-0.5 - math.log(0.5) - 0.5 * math.log(2 * math.pi))


def test_guidance():
    vc, vu = torch.tensor([2.0]), torch.tensor([1.0])
    assert guided(vc, vu, 4.5).item() == pytest.approx(1.0 + 4.5 * 1.0)
    assert guided(vc, None, 4.5).item() == 2.0


@pytest.fixture(scope="module")
def wan():
    from posttrain.modules.presets import build_model

    torch.manual_seed(0)
    return build_model("wan_t2v").eval()


def test_c2_identity_recompute_equals_stored(wan):
    """Recomputing every SDE step's log p of a captured rollout under unchanged weights gives the stored
    value (PPO ratio 1); a different guidance scale at recompute breaks it."""
    sampler = FlowMatchSampler(num_steps=4, guidance_scale=1.0)
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(2, 16, 3, 4, 4, generator=g)
    cond, uncond = torch.randn(2, 8, 32, generator=g), torch.randn(2, 8, 32, generator=g)
    fn = velocity_of(wan)
    with torch.no_grad():
        traj = sampler.sample(fn, noise, cond, uncond, sde=True, capture=True, generator=g)
        assert traj.xs.shape == (5, 2, 16, 3, 4, 4) and traj.log_probs.shape == (4, 2)
        gaps = [(sampler.step_log_prob(fn, traj, i, cond, uncond).log_prob - traj.log_probs[i]).abs().max()
                for i in range(4)]
        assert max(gaps) < 1e-5
        off = sampler.step_log_prob(fn, traj, 1, cond, uncond, guidance_scale=5.0).log_prob
        assert (off - traj.log_probs[1]).abs().max() > 1e-3


def test_ode_is_deterministic_and_sde_is_not(wan):
    sampler = FlowMatchSampler(num_steps=3)
    noise = torch.randn(1, 16, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    cond = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1))
    fn = velocity_of(wan)
    with torch.no_grad():
        a = sampler.sample(fn, noise, cond).latents
        b = sampler.sample(fn, noise, cond).latents
        c = sampler.sample(fn, noise, cond, sde=True, generator=torch.Generator().manual_seed(3)).latents
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_batched_cfg_equals_two_passes(wan):
    sampler = FlowMatchSampler(num_steps=2, guidance_scale=4.0)
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(2, 16, 3, 4, 4, generator=g), torch.randn(2, 8, 32, generator=g)
    uncond = torch.zeros_like(cond)
    fn = velocity_of(wan)
    t = torch.tensor(600.0)
    with torch.no_grad():
        v = sampler.velocity(fn, x, t, cond, uncond)
        vc, vu = fn(x, t.expand(2), cond), fn(x, t.expand(2), uncond)
    torch.testing.assert_close(v, vu + 4.0 * (vc - vu), atol=1e-5, rtol=1e-4)


def test_bad_sampler_settings():
    with pytest.raises(ValueError, match="num_steps=0"):
        FlowMatchSampler(num_steps=0)
    with pytest.raises(ValueError, match="sde_window"):
        FlowMatchSampler(num_steps=4, sde_window=(2, 9))
