"""Self-Forcing mechanics on the embedded default: DMD2 with a block-causal student (tiny ``wan_t2v_causal``) and
a chunked sampler, 5×16×16 videos = 2 latent frames, one latent frame per chunk (2 chunks), 4-step list, CPU.

What is asserted: the rollout is the serving path (chunk loop, KV cache) and equals it; the student's only grad
comes from the exit step of each chunk; versions of student and critic move on their own schedules; start-up
errors name the option; and learning: configs/self_forcing.yaml, with the pretrained world's generator as teacher,
brings the chunked student's samples closer to the teacher's, and a zero student learning rate does not.
"""
from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from posttrain.datamodules.prompts import Prompts
from posttrain.datamodules.synthetic import PRETRAIN_EXCLUDE, ShapesDataset
from posttrain.lit.base import RunArgs
from posttrain.lit.dmd2 import DMD2
from posttrain.modules.models.cards import Expert, ModelCard
from posttrain.modules.flow.samplers import FlowMatchSampler
from tests.helpers import late_windows, quick_trainer
from tests.test_dmd2 import adam, distill_card, fit_and_measure, weights

WORLD21 = "modules/assets/world21"  # the long world (21-frame clips), as configs/self_forcing_long.yaml names it

SIZE = RunArgs(frames=5, height=16, width=16)  # (5 - 1) / 4 + 1 = 2 latent frames


def chunked_sampler(chunk_frames=1, **kwargs) -> FlowMatchSampler:
    return FlowMatchSampler(num_steps=4, step_sigmas=[1.0, 0.75, 0.5, 0.25], chunk_frames=chunk_frames,
                            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, stochastic_sampling=True), **kwargs)


def self_forcing(card=None, chunk_frames=1, ratio: int = 2, run: RunArgs = SIZE) -> DMD2:
    torch.manual_seed(0)
    return DMD2(card or distill_card(student_arch="wan_t2v_causal"), chunked_sampler(chunk_frames),
                generator_update_ratio=ratio, teacher_sampler=FlowMatchSampler(num_steps=4), run=run)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def record_student_calls(module) -> list[tuple[bool, bool, bool]]:
    """(grad enabled, reads a cache, writes the cache) of every student forward."""
    calls = []
    module.card["transformer"].register_forward_pre_hook(
        lambda _m, args, kwargs: calls.append((torch.is_grad_enabled(), kwargs.get("kv_cache") is not None,
                                               bool(kwargs.get("update_cache")))), with_kwargs=True)
    return calls


def test_training_rollout_is_the_served_chunk_loop():
    """``generate`` (predict, sample videos) runs the student chunk by chunk through a KV cache — 4 steps per chunk,
    one cache write between the 2 chunks — and the training rollout stopped at the last step gives the served
    latents bit for bit from the same noise and generator (train ≡ serve)."""
    module = self_forcing()
    module.configure_model()
    calls = record_student_calls(module)
    prompts = ["a red circle moving left on a blue background", "a green square moving up on a black background"]
    served = module.generate(prompts, seed=3, latents_only=True)
    assert calls == [(False, True, False)] * 4 + [(False, True, True)] + [(False, True, False)] * 4
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(served.shape, generator=g)
    cond = module.stage.condition(prompts)
    rollout = module.stage.sample(module.sampler, noise, cond, name="transformer", exit_step=3, rng=g).latents
    assert rollout.requires_grad and torch.equal(rollout.detach(), served)
    # the causal student, not a bidirectional pass: the first chunk alone gives the first chunk
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(served.shape, generator=g)
    alone = module.stage.sample(module.sampler, noise[:, :, :1], cond, name="transformer", rng=g).latents
    assert torch.equal(alone, served[:, :, :1])


def test_exit_steps_carry_the_only_grad_and_versions_keep_their_own_schedules():
    """Ratio 2 over 4 iterations: on iterations 0 and 2 the student forwards with grad exactly once per chunk (its
    exit step), never in the cache writes; on 1 and 3 never. Student version 2, critic 4, teacher 0. (That the
    exit step is the same on every process is checked on 2 processes in tests/test_dmd2.py: both methods draw it
    alike.)"""
    module = self_forcing()
    module.configure_model()
    calls = record_student_calls(module)
    per_iteration = []
    module.on_train_batch_end = lambda *_: per_iteration.append(list(calls)) or calls.clear()
    quick_trainer(max_steps=4).fit(module, Prompts(num_synthetic=8, batch_size=2))
    assert len(per_iteration) == 4
    for i, iteration in enumerate(per_iteration):
        with_grad = [c for c in iteration if c[0]]
        assert len(with_grad) == (2 if i % 2 == 0 else 0), (i, iteration)
        assert not any(c[0] and c[2] for c in iteration)  # cache writes never carry grad
        assert sum(c[2] for c in iteration) == 1  # one write between the two chunks
    versions = module.card.versions
    assert versions["transformer"] == 2 and versions["critic"] == 4 and versions["teacher"] == 0


def test_student_learns_from_the_teacher_weights_and_moves():
    """The causal student starts from the bidirectional teacher's state dict and its DMD steps change it."""
    module = self_forcing()
    module.configure_model()
    teacher, start = weights(module, "teacher"), weights(module, "transformer")
    assert all(torch.equal(teacher[k], start[k]) for k in teacher)
    quick_trainer(max_steps=3).fit(module, Prompts(num_synthetic=8, batch_size=2))
    end = weights(module, "transformer")
    assert max((start[k] - end[k]).abs().max().item() for k in start) > 1e-4


def test_bad_settings_name_the_option():
    with pytest.raises(ValueError, match=r"sampler.chunk_frames=1 samples chunk by chunk.*set `arch: wan_t2v_causal`"):
        self_forcing(distill_card())
    with pytest.raises(ValueError, match=r"generator_update_ratio=0 must be >= 1"):
        self_forcing(ratio=0)
    with pytest.raises(ValueError, match=r"the card has no 'critic'"):
        self_forcing(distill_card(student_arch="wan_t2v_causal", critic=None))
    module = self_forcing(chunk_frames=3, run=RunArgs(frames=9, height=16, width=16))  # 3 latent frames: fine
    module.configure_model()
    module = self_forcing(chunk_frames=2, run=RunArgs(frames=9, height=16, width=16))
    with pytest.raises(ValueError, match=r"sampler.chunk_frames=2 does not divide the 3 latent frames of "
                                         r"run.frames=9"):
        module.configure_model()


def test_served_rolling_cache_keeps_the_last_chunks():
    """``sampler.cache_chunks: 1`` over 3 latent frames (9 frames): served, the cache holds one chunk after every
    write (the plain one two), and the video is the plain cache's for the first two chunks (chunk 1 sees chunk 0,
    within the window) and not for the third (chunk 0 was evicted)."""
    module = self_forcing(run=RunArgs(frames=9, height=16, width=16))
    module.configure_model()
    stored = []
    module.card["transformer"].register_forward_hook(
        lambda _m, _args, kwargs, _out: stored.append(kwargs["kv_cache"].stored_frames)
        if kwargs.get("update_cache") else None, with_kwargs=True)
    prompts = ["a red circle moving left on a blue background", "a green square moving up on a black background"]
    plain = module.generate(prompts, seed=3, latents_only=True)
    assert stored == [1, 2]
    stored.clear()
    module.sampler = chunked_sampler(cache_chunks=1)
    rolled = module.generate(prompts, seed=3, latents_only=True)
    assert stored == [1, 1]
    assert torch.equal(rolled[:, :, :2], plain[:, :, :2])
    assert (rolled[:, :, 2] - plain[:, :, 2]).abs().max() > 1e-4


def test_rolling_cache_settings_name_the_option():
    with pytest.raises(ValueError, match=r"sampler: cache_chunks=2 .* needs chunk_frames"):
        FlowMatchSampler(num_steps=4, cache_chunks=2)
    with pytest.raises(ValueError, match=r"cache_chunks=0 .* W >= 1"):
        chunked_sampler(cache_chunks=0)
    with pytest.raises(ValueError, match=r"sampler: sink_chunks=1 must be >= 0 and needs cache_chunks"):
        chunked_sampler(sink_chunks=1)


# ------------------------------------------------------------------ learning, against the pretrained world's teacher
@pytest.mark.slow
def test_the_chunked_student_comes_closer_to_the_teacher(tmp_path):
    """configs/self_forcing.yaml for 100 iterations: the causal student starts from the bidirectional teacher's
    weights, which run chunk by chunk with the KV cache draw far from the teacher's 20-step CFG samples (Fréchet
    VAE distance 2.1, GenEval all 0.34 on experiments/distill.py's 32 prompts); training on its own rollouts brings both
    closer (experiments/distill.py: 0.69 and 0.69 after 200 iterations)."""
    _, before, after, _ = fit_and_measure("configs/self_forcing.yaml", tmp_path, 100)
    assert after["frechet"] < 0.6 * before["frechet"], (before, after)
    assert after["all"] > before["all"] + 0.1, (before, after)


@pytest.mark.slow
def test_zero_student_lr_control_leaves_the_student_and_its_samples_unchanged(tmp_path):
    """The same run with the student's learning rate 0 (AdamW's decoupled decay is lr × weight_decay: none): the
    critic trains, the student and its samples stay bitwise what they were."""
    module, before, after, start = fit_and_measure(
        "configs/self_forcing.yaml", tmp_path, 10, "--model.init_args.card.experts.transformer.optimizer.init_args.lr",
        "0.0")
    end = weights(module, "transformer")
    assert all(torch.equal(start[k], end[k]) for k in start)
    assert before == after
    assert module.card.versions["transformer"] == 2 and module.card.versions["critic"] == 10
    assert max((a - b).abs().max().item() for a, b in zip(weights(module, "critic").values(),
                                                           weights(module, "teacher").values())) > 1e-5


# ------------------------------------------------------------------ the long world: late chunks need the cache
def long_world_student(chunk_frames: int = 1) -> DMD2:
    """configs/self_forcing_long.yaml's card and sampler in code: the long world's text encoder and teacher, the
    causal student started from the teacher; 21-frame clips (6 latent frames)."""
    card = ModelCard({
        "text_encoder": Expert(arch="umt5", pretrained=WORLD21, subfolder="umt5"),
        "vae": Expert(arch="wan_vae", pretrained=WORLD21, subfolder="wan_vae"),
        "teacher": Expert(arch="wan_t2v", pretrained=WORLD21, subfolder="wan_t2v"),
        "transformer": Expert(arch="wan_t2v_causal", trainable=True, optimizer=adam(1e-4), init_from="teacher"),
        "critic": Expert(arch="wan_t2v", trainable=True, optimizer=adam(1e-4), init_from="teacher")},
        text_max_length=64)
    return self_forcing(card, chunk_frames, run=RunArgs(frames=21, height=32, width=32))


def test_late_chunks_continue_the_earlier_ones_through_the_kv_cache_and_not_without_it():
    """The long world's teacher weights run chunk by chunk (the student before training, 1 latent frame a chunk) on
    8 seen-concept prompts. Through the KV cache each latent frame continues the one before it: the mean squared
    step between consecutive latent frames is 0.18; with the cache dropped (each chunk generated alone, seeing no
    earlier chunk) every latent frame is its own draw from the prompt and the step is 0.28. The late windows' scores
    are reported, not asserted: before training the chunked teacher keeps its background in 0.56 of them through the
    cache, while each chunk alone is a clean first frame of the prompt (1.0) that moves nowhere (motion 0.19; 0.22
    cached) — what Self-Forcing's training has to join (experiments/distill.py --per-chunk has the trained student's
    per-window scores)."""
    module = long_world_student()
    module.configure_model()
    data = ShapesDataset(8, 1, 8, 8, seed=5, exclude=PRETRAIN_EXCLUDE)
    prompts = [data[i]["prompt"] for i in range(8)]
    cached = module.generate(prompts, seed=0, latents_only=True)
    g = torch.Generator().manual_seed(0)  # generate's noise, then each chunk alone, each with a fresh empty cache
    noise = torch.randn(cached.shape, generator=g)
    cond = module.stage.condition(prompts)
    dropped = torch.cat([module.stage.sample(module.sampler, noise[:, :, k:k + 1], cond, name="transformer",
                                             rng=g).latents for k in range(cached.shape[2])], dim=2)
    assert torch.equal(dropped[:, :, 0], cached[:, :, 0])  # the first chunk has no history either way

    def step(latents: torch.Tensor) -> float:
        return (latents[:, :, 1:] - latents[:, :, :-1]).pow(2).mean().item()

    with_cache, without = step(cached), step(dropped)
    print("late windows, cached:", late_windows(module.stage.decode(cached), prompts))
    print("late windows, cache dropped:", late_windows(module.stage.decode(dropped), prompts))
    assert with_cache <= 0.8 * without, (with_cache, without)
