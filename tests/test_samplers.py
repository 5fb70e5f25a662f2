"""The one sampler: σ schedules, the Flow-GRPO SDE step and its log-probability, log-probability parity."""
from __future__ import annotations

import math

import pytest
import torch

from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from posttrain.modules.flow.conditioning import Conditioning
from posttrain.modules.models.generators import ADAPTERS
from posttrain.modules.flow.samplers import (
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
    step = sde_step(x, v, torch.tensor(0.5), torch.tensor(0.25), noise_level=0.7, sigma_cap=0.9, rng=g)
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
    step = sde_step(x, v, sigma, sigma_next, 0.7, 0.9, rng=g)
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


def test_guidance_rescale_pulls_the_guided_std_to_the_conditional_one():
    """CFG rescale (Lin et al. 2023): φ = 1 gives each sample the conditional velocity's std and keeps the guided
    direction; φ = 0.7 blends; φ = 0 is plain CFG. A sampler out of [0, 1] is refused by name."""
    g = torch.Generator().manual_seed(0)
    vc, vu = torch.randn(2, 4, 3, 4, 4, generator=g), torch.randn(2, 4, 3, 4, 4, generator=g)
    plain, full, part = guided(vc, vu, 3.0), guided(vc, vu, 3.0, 1.0), guided(vc, vu, 3.0, 0.7)
    per_sample = dict(dim=(1, 2, 3, 4))
    assert torch.allclose(full.std(**per_sample), vc.std(**per_sample))
    assert torch.all(plain.std(**per_sample) > 2 * vc.std(**per_sample))
    assert torch.allclose(torch.nn.functional.normalize(full.flatten(1), dim=1),
                          torch.nn.functional.normalize(plain.flatten(1), dim=1), atol=1e-6)
    assert torch.allclose(part, 0.7 * full + 0.3 * plain) and torch.equal(guided(vc, vu, 3.0, 0.0), plain)
    with pytest.raises(ValueError, match=r"guidance_rescale=1.5 must be in \[0, 1\] \(0 = plain CFG"):
        FlowMatchSampler(guidance_rescale=1.5)


@pytest.fixture(scope="module")
def wan():
    from posttrain.modules.models.presets import build_model

    torch.manual_seed(0)
    return build_model("wan_t2v").eval()


def test_logprob_parity_recompute_equals_stored(wan):
    """Recomputing every SDE step's log p of a captured rollout under unchanged weights gives the stored
    value (PPO ratio 1); a different guidance scale at recompute breaks it."""
    sampler = FlowMatchSampler(num_steps=4, guidance_scale=1.0)
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(2, 16, 3, 4, 4, generator=g)
    cond, uncond = torch.randn(2, 8, 32, generator=g), torch.randn(2, 8, 32, generator=g)
    fn = velocity_of(wan)
    with torch.no_grad():
        traj = sampler.sample(fn, noise, cond, uncond, sde=True, capture=True, rng=g)
        assert traj.xs.shape == (5, 2, 16, 3, 4, 4) and traj.log_probs.shape == (4, 2)
        gaps = [(sampler.step_log_prob(fn, traj, i, cond, uncond).log_prob - traj.log_probs[i]).abs().max()
                for i in range(4)]
        assert max(gaps) < 1e-5
        off = FlowMatchSampler(num_steps=4, guidance_scale=5.0).step_log_prob(fn, traj, 1, cond, uncond).log_prob
        assert (off - traj.log_probs[1]).abs().max() > 1e-3


def test_ode_is_deterministic_and_sde_is_not(wan):
    sampler = FlowMatchSampler(num_steps=3)
    noise = torch.randn(1, 16, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    cond = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1))
    fn = velocity_of(wan)
    with torch.no_grad():
        a = sampler.sample(fn, noise, cond).latents
        b = sampler.sample(fn, noise, cond).latents
        c = sampler.sample(fn, noise, cond, sde=True, rng=torch.Generator().manual_seed(3)).latents
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


# ---------------------------------------------------------------------- few-step students (DMD2, Self-Forcing)
def student_sampler(**kwargs) -> FlowMatchSampler:
    """The anchors' 4-step student: σ ∈ {1, .75, .5, .25} through the scheduler's shift, re-noise step."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, stochastic_sampling=True)
    return FlowMatchSampler(num_steps=4, step_sigmas=[1.0, 0.75, 0.5, 0.25], scheduler=scheduler, **kwargs)


def test_step_list_goes_through_the_schedulers_shift():
    """shift 3: σ' = 3σ/(1 + 2σ) gives 1 → 1, .75 → 2.25/2.5 = .9, .5 → 1.5/2 = .75, .25 → .75/1.5 = .5, then 0;
    timesteps 1000·σ' — exactly ``set_timesteps(sigmas=[1, .75, .5, .25])``."""
    schedule = student_sampler().schedule()
    torch.testing.assert_close(schedule.sigmas, torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0]))
    torch.testing.assert_close(schedule.timesteps, torch.tensor([1000.0, 900.0, 750.0, 500.0]))
    reference = FlowMatchEulerDiscreteScheduler(shift=3.0)
    reference.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.25])
    assert torch.equal(schedule.sigmas, reference.sigmas) and torch.equal(schedule.timesteps, reference.timesteps)
    assert not torch.equal(FlowMatchSampler(num_steps=4).schedule().sigmas, schedule.sigmas)  # not the default grid


def test_renoise_step_is_the_stochastic_schedulers_step(wan):
    """Each step x̂0 = x - σ·v, x_next = (1-σ')·x̂0 + σ'·ε: ``FlowMatchEulerDiscreteScheduler(stochastic_sampling=
    True).step`` fed the same generator gives the same chain; the plain Euler step (ε predicted, not fresh) does not."""
    sampler = student_sampler()
    fn = velocity_of(wan)
    noise = torch.randn(2, 16, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    cond = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    reference = FlowMatchEulerDiscreteScheduler(shift=3.0, stochastic_sampling=True)
    reference.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.25])
    g_ours, g_ref = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    x = noise
    with torch.no_grad():
        ours = sampler.sample(fn, noise, cond, rng=g_ours).latents
        for t in reference.timesteps:
            x = reference.step(fn(x, t.expand(2), cond).float(), t, x, generator=g_ref, return_dict=False)[0]
        euler = FlowMatchSampler(num_steps=4, step_sigmas=[1.0, 0.75, 0.5, 0.25]).sample(fn, noise, cond).latents
    torch.testing.assert_close(ours, x, atol=1e-6, rtol=1e-6)
    assert (ours - euler).abs().max() > 1e-2


def test_exit_step_keeps_grad_only_at_the_exit(wan):
    """exit_step=k returns x̂0 = x_k - σ_k·v(x_k) of the same chain the full sample walks (same generator); only the
    k-th model call runs with grad. At k = T-1 it is the served sample itself (train ≡ serve)."""
    sampler = student_sampler()
    calls = []

    def fn(x, t, c):
        calls.append(torch.is_grad_enabled())
        return velocity_of(wan)(x, t, c)

    noise = torch.randn(2, 16, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    cond = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = sampler.sample(fn, noise, cond, capture=True, rng=torch.Generator().manual_seed(7))
    schedule = sampler.schedule()
    for k in range(4):
        calls.clear()
        x0 = sampler.sample(fn, noise, cond, exit_step=k, rng=torch.Generator().manual_seed(7)).latents
        assert calls == [False] * k + [True] and x0.requires_grad
        with torch.no_grad():
            expected = full.xs[k] - schedule.sigmas[k] * fn(full.xs[k], schedule.timesteps[k].expand(2), cond)
        torch.testing.assert_close(x0.detach(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(x0.detach(), full.latents)


def test_few_step_settings_are_checked():
    with pytest.raises(ValueError, match=r"step_sigmas=\[\] is empty.*num_steps: 4"):
        FlowMatchSampler(num_steps=4, step_sigmas=[])
    with pytest.raises(ValueError, match=r"has 4 steps but num_steps=20; set num_steps: 4"):
        FlowMatchSampler(step_sigmas=[1.0, 0.75, 0.5, 0.25])
    with pytest.raises(ValueError, match="decrease strictly"):
        FlowMatchSampler(num_steps=2, step_sigmas=[0.5, 0.75])
    with pytest.raises(ValueError, match="chunk_frames=0"):
        FlowMatchSampler(chunk_frames=0)
    with pytest.raises(ValueError, match=r"exit_step=4 must be in \[0, num_steps=4\)"):
        student_sampler().sample(lambda x, t, c: x, torch.zeros(1, 16, 1, 2, 2), None, exit_step=4)


# ---------------------------------------------------------------------- the chunk loop of a block-causal model
@pytest.fixture(scope="module")
def causal(wan):
    from posttrain.modules.models.causal_wan import CausalWanTransformer3DModel

    return CausalWanTransformer3DModel.from_bidirectional(wan, num_frames_per_chunk=1).eval()


def causal_fn(model, calls=None):
    def fn(x, t, c, **kwargs):
        if calls is not None:
            calls.append((torch.is_grad_enabled(), kwargs.get("update_cache", False), x.shape[2]))
        return ADAPTERS["wan_t2v_causal"].velocity(model, x, t, Conditioning(encoder_hidden_states=c), **kwargs)
    return fn


def test_chunk_loop_equals_recomputing_the_history(causal):
    """Chunk by chunk through the KV cache (each finished chunk stored at σ = 0) equals, within 1e-5, the same
    chain run without a cache: every step a block-causal forward over [finished chunks at t = 0, current chunk]."""
    sampler = student_sampler(chunk_frames=1)
    schedule = sampler.schedule()
    noise = torch.randn(2, 16, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    cond = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cached = sampler.sample(causal_fn(causal), noise, cond, kv_cache=causal.new_cache(),
                                rng=torch.Generator().manual_seed(3)).latents
        g, done = torch.Generator().manual_seed(3), []
        for k in range(3):
            x = noise[:, :, k:k + 1]
            for i in range(4):
                video = torch.cat([*done, x], dim=2)
                t = torch.cat([torch.zeros(2, k), schedule.timesteps[i].expand(2, 1)], dim=1)
                v = causal(video, t, cond, num_frames_per_chunk=1).sample[:, :, -1:]
                x0 = x - schedule.sigmas[i] * v
                s_next = schedule.sigmas[i + 1]
                x = x0 if s_next == 0 else (1 - s_next) * x0 + s_next * torch.randn(x0.shape, generator=g)
            done.append(x)
    assert cached.shape == noise.shape
    assert (cached - torch.cat(done, dim=2)).abs().max() < 1e-5


def test_chunk_loop_exit_steps_carry_the_only_grad(causal):
    """With exit_step=k every chunk runs k steps without grad, its exit step with grad, and (but the last) one
    context pass at σ = 0 without grad that writes the cache; the video's gradient reaches the student."""
    sampler = student_sampler(chunk_frames=1)
    noise = torch.randn(1, 16, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    cond = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1))
    calls = []
    causal.zero_grad(set_to_none=True)
    video = sampler.sample(causal_fn(causal, calls), noise, cond, exit_step=2, kv_cache=causal.new_cache(),
                           rng=torch.Generator().manual_seed(3)).latents
    chunk = [(False, False, 1), (False, False, 1), (True, False, 1)]
    assert calls == chunk + [(False, True, 1)] + chunk + [(False, True, 1)] + chunk
    video.square().mean().backward()
    assert max(p.grad.abs().max().item() for p in causal.parameters() if p.grad is not None) > 0
    causal.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match=r"chunk_frames=2 does not divide the 3 latent frames"):
        student_sampler(chunk_frames=2).sample(causal_fn(causal), noise, cond, kv_cache=causal.new_cache())
