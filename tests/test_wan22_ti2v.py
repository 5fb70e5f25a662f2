"""Wan 2.2 TI2V-5B, a family added as one file (``modules/models/generators/wan22_ti2v.py``): one transformer does
text-to-video and image-to-video (the first latent frame the image's, clean at timestep 0), the sampler holds that
frame clean through ODE and SDE steps with FlowGRPO's log-probability parity holding, finetune runs both ways and
leaves the clean frame out of what it trains, DMD2 distils it both ways (image-to-video: every score and teacher
sample from each row's first frame), and the exported ``WanPipeline`` / ``WanImageToVideoPipeline`` (both
``expand_timesteps=True``) reproduce the package's samples from the same noise (float32)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from diffusers import WanImageToVideoPipeline, WanPipeline
from lightning.pytorch import Callback

from posttrain.callbacks.parity import LogProbParityCheck
from posttrain.datamodules.folder import FolderDataset, VideoFolder
from posttrain.datamodules.synthetic import SyntheticVideos
from posttrain.lit.base import RunArgs
from posttrain.lit.diffusion_nft import DiffusionNFT
from posttrain.lit.dmd2 import DMD2
from posttrain.lit.finetune import Finetune
from posttrain.lit.flow_grpo import FlowGRPO
from posttrain.lit.tools.export import export
from posttrain.modules.distill.args import GANArgs, RegressionArgs
from posttrain.modules.flow.losses import noised
from posttrain.modules.flow.samplers import FlowMatchSampler, gaussian_log_prob
from posttrain.modules.models import presets
from posttrain.modules.models.cards import Expert, LoraConfig, ModelCard
from posttrain.modules.models.generators import GeneratorStage, VideoSize
from posttrain.modules.models.generators.base import codec_of
from posttrain.modules.models.generators.wan import WanVAE
from posttrain.modules.rewards.synthetic import ColourAlignment
from posttrain.modules.rl.grpo import GRPOArgs
from posttrain.modules.rl.rollout import Rollout
from tests.conftest import adamw, i2v_card
from tests.helpers import (dmd2_steps_student_and_critic_twice, fit_shipped_config_once,
                           joint_rl_steps_refiner_and_generator, quick_trainer)
from tests.test_estimate import shipped_config_estimate_matches_a_real_forward
from tests.test_export_generators import finetuned as export_finetuned
from tests.test_folder_data import caption, clip

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["a red circle moving left on a blue background", "a yellow square moving down on a green background"]
SIZE = VideoSize(frames=9, height=32, width=32)  # latents (48, 3, 4, 4): 12 tokens


def ti2v_card(arch: str = "wan22_ti2v", lr: float = 1e-3) -> ModelCard:
    """The world's UMT5 (frozen), the world's Wan 2.2 VAE (frozen) and the trainable pretrained tiny TI2V."""
    return ModelCard({"text_encoder": Expert(arch="umt5"), "vae": Expert(arch="wan22_vae"),
                      "transformer": Expert(arch=arch, trainable=True, optimizer=adamw(lr))}, text_max_length=32)


def videos(n: int = 2) -> torch.Tensor:
    """(n, 3, 9, 64, 64) synthetic clips in [-1, 1]."""
    data = SyntheticVideos(frames=SIZE.frames, height=SIZE.height, width=SIZE.width).train_dataset()
    return torch.stack([data[i]["video"] for i in range(n)])


@pytest.fixture(scope="module")
def stage():
    torch.manual_seed(0)
    card = ti2v_card()
    card.build()
    return GeneratorStage(card)


def test_the_tiny_presets_are_the_wan22_layout():
    """48 latent channels through 2x2 pixel patches, 8x spatial (the world's scale: the published VAE's four levels
    less one, as the world's Wan 2.1 VAE is 4x) and 4x temporal, its latent statistics its own; the transformer reads
    the 48 channels alone (no mask channels, no image encoder). Both archs load the one shipped transformer."""
    vae = presets.build_model("wan22_vae")
    assert vae.config.z_dim == 48 and vae.config.is_residual and vae.config.patch_size == 2
    assert (vae.config.scale_factor_temporal, vae.config.scale_factor_spatial) == (4, 8)
    assert len(vae.config.latents_mean) == len(vae.config.latents_std) == 48
    assert vae.config.latents_std != presets.PRESETS["wan22_vae"]["latents_std"]  # measured on the world
    assert isinstance(codec_of(vae), WanVAE)  # Wan 2.1's codec serves it: patchify and 8x are in its config
    assert codec_of(vae).encode(vae, videos(1)[:, :, :5]).shape == (1, 48, 2, 4, 4)
    transformer = presets.build_model("wan22_ti2v")
    assert transformer.config.in_channels == transformer.config.out_channels == 48
    assert transformer.config.image_dim is None
    i2v = presets.build_model("wan22_ti2v_i2v")
    assert all(torch.equal(v, i2v.state_dict()[k]) for k, v in transformer.state_dict().items())


def shipped_samples(images: torch.Tensor | None, prompts: list[str], seed: int) -> torch.Tensor:
    """ODE samples of the shipped tiny TI2V through the evaluation path (20 steps, no CFG), 5 x 32 x 32."""
    from posttrain.modules.eval.evaluation import generate
    from transformers import ByT5Tokenizer

    return generate(presets.build_model("wan22_ti2v").eval(), presets.build_model("umt5").eval(), ByT5Tokenizer(),
                    presets.build_model("wan22_vae").eval(), prompts, seed=seed, frames=5, height=32, width=32,
                    arch="wan22_ti2v", images=images)


def test_the_shipped_tiny_ti2v_follows_the_prompt_and_the_image(one_thread):
    """The presets without overrides are the pretrained tiny TI2V (scripts/train_ti2v.py: one transformer trained on
    the world for text-to-video and image-to-video together) over the world's Wan 2.2 VAE (scripts/train_vae.py
    --arch wan22_vae). On 32 prompts of concepts it saw, from a seed its training never used, without CFG: from text
    alone, colour, background and motion read back far above chance (1/6, 1/6, 1/4) and above what the same clips
    score against the batch's other prompts; from each prompt's own first frame, the clip keeps that frame and
    moves as the prompt says (motion is what the image does not give)."""
    from posttrain.datamodules.synthetic import PRETRAIN_EXCLUDE, ShapesDataset
    from posttrain.modules.world.geneval import judge

    data = ShapesDataset(32, 5, 32, 32, seed=31, exclude=PRETRAIN_EXCLUDE)
    prompts = [data[i]["prompt"] for i in range(32)]
    facts = ("shape", "colour", "background", "motion")
    results = {}
    for task, images in {"t2v": None, "i2v": torch.stack([data[i]["video"][:, 0] for i in range(32)])}.items():
        clips = shipped_samples(images, prompts, seed=31)
        matched = {k: float(v.nanmean()) for k, v in judge(clips, prompts).items() if k in facts}
        others = {k: float(v.nanmean()) for k, v in judge(clips, prompts[1:] + prompts[:1]).items() if k in facts}
        results[task] = (matched, others)
        print(f"shipped tiny TI2V, {task}: {matched}; against other prompts {others}")
    (t2v, t2v_others), (i2v, i2v_others) = results["t2v"], results["i2v"]
    # measured: text-to-video colour 0.84, background 1.0, motion 0.81 (0.13, 0.22, 0.22 against other prompts);
    # image-to-video 1.0, 1.0, 1.0 (motion 0.31 against other prompts); shape 0.44 and 0.66 (chance 1/3)
    assert t2v["colour"] >= 0.75 and t2v["background"] >= 0.9 and t2v["motion"] >= 0.65, t2v
    assert all(t2v[k] > t2v_others[k] + 0.3 for k in ("colour", "background", "motion")), t2v_others
    assert i2v["colour"] >= 0.9 and i2v["background"] >= 0.9 and i2v["motion"] >= 0.85, i2v
    assert i2v["motion"] > i2v_others["motion"] + 0.3, i2v_others


def test_a_patch_the_pipelines_cannot_serve_is_refused():
    card = ModelCard({"text_encoder": Expert(arch="umt5"), "vae": Expert(arch="wan22_vae"),
                      "transformer": Expert(arch="wan22_ti2v", preset={"patch_size": [1, 1, 1]})}, text_max_length=32)
    card.build()
    with pytest.raises(ValueError, match=r"patch_size is \[1, 1, 1\], but the TI2V pipelines' per-token timesteps "
                                         r"assume \[1, 2, 2\]: drop patch_size from its preset"):
        GeneratorStage(card).latent_shape(SIZE)


def test_one_transformer_generates_from_text_and_from_a_first_frame(stage, one_thread):
    """The same weights sample from text alone and from an image: with an image the first latent frame is the
    image's latents (the VAE's first latent frame of the clip: the encoder is causal) at every σ of the
    trajectory; from text alone it is generated."""
    clips = videos()
    image_cond = stage.condition(PROMPTS, images=clips[:, :, 0], size=SIZE)
    first = image_cond["first_frame_latents"]  # (2, 48, 1, 4, 4)
    assert first.shape == (2, 48, 1, 4, 4)
    assert torch.allclose(stage.encode(clips)[:, :, :1], first, atol=1e-5)
    noise = torch.randn((2, *stage.latent_shape(SIZE)), generator=torch.Generator().manual_seed(0))
    sampler = FlowMatchSampler(num_steps=4)
    i2v = stage.sample(sampler, noise, image_cond, capture=True)
    assert all(torch.equal(x[:, :, :1], first) for x in i2v.xs)  # from the noise to the sample
    t2v = stage.sample(sampler, noise, stage.condition(PROMPTS), capture=True)
    assert torch.equal(t2v.xs[0], noise) and (t2v.latents[:, :, :1] - first).abs().max() > 0.1
    assert (i2v.latents[:, :, 1:] - t2v.latents[:, :, 1:]).abs().max() > 1e-3  # the image conditions the rest


def test_the_clean_frame_is_not_trained(stage, one_thread):
    """At any σ, the first frame's velocity is the flow's given x0 = the image's latents, (x_σ - c)/σ: finetune's
    target ε - x0 exactly on that frame, and no gradient reaches the weights from it (the generated frames' does)."""
    clips = videos()
    cond = stage.condition(PROMPTS, images=clips[:, :, 0], size=SIZE)
    x0 = stage.encode(clips)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.3, 0.8])
    transformer = stage.card["transformer"]
    v = stage.adapter.velocity(transformer, noised(x0, noise, sigma), sigma * 1000, cond)
    assert torch.allclose(v[:, :, :1], (noise - x0)[:, :, :1], atol=1e-4)
    v[:, :, :1].sum().backward(retain_graph=True)
    assert all(p.grad is None or not p.grad.any() for p in transformer.parameters())
    v[:, :, 1:].sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in transformer.parameters())
    transformer.zero_grad(set_to_none=True)


def test_sde_rollout_keeps_the_first_frame_clean_and_logprob_parity_holds(stage, one_thread):
    """FlowGRPO's rollout in image-to-video: the first frame stays the image's through every SDE step, each step's
    log p is the Gaussian density of the generated frames alone, and recomputing it at the rollout's weights gives
    it back (the parity check; also for a subset of rows, as minibatches recompute)."""
    clips = videos()
    cond, uncond = stage.conditioning(PROMPTS, 3.0, images=clips[:, :, 0], size=SIZE)
    sampler = FlowMatchSampler(num_steps=4, guidance_scale=3.0, noise_level=0.7)
    rollout = Rollout.sample(stage, sampler, cond, uncond, stage.latent_shape(SIZE), torch.Generator().manual_seed(0))
    traj, first = rollout.traj, cond["first_frame_latents"]
    assert all(torch.equal(x[:, :, :1], first) for x in traj.xs)
    step = rollout.step_log_prob(1)
    scale = step.std * torch.sqrt(traj.sigmas[1] - traj.sigmas[2])
    generated = gaussian_log_prob(traj.xs[2][:, :, 1:], step.mean[:, :, 1:], scale)
    assert torch.allclose(traj.log_probs[1], generated, atol=1e-5)
    assert torch.equal(step.mean[:, :, :1], first)  # a KL of means is 0 on the clean frame
    gap = rollout.logprob_gap().item()
    print(f"TI2V image-to-video SDE rollout: log-probability parity gap {gap:.2e}")
    assert gap < 1e-5 and rollout.select(torch.tensor([1])).logprob_gap() < 1e-5


def test_flow_grpo_image_to_video_passes_its_logprob_parity_check(tmp_path, one_thread):
    """FlowGRPO in image-to-video through the Trainer (each clip's first frame, K = 2 rows per prompt, CFG 3): the
    ``LogProbParityCheck`` callback recomputes the rollout's log p before the update and finds it (tolerance 1e-5,
    raising), and the update moves the transformer."""
    parity = LogProbParityCheck(tolerance=1e-5, on_violation="raise")
    snapshot = Snapshot()
    module = FlowGRPO(ti2v_card("wan22_ti2v_i2v", lr=1e-2), reward=ColourAlignment(),
                      sampler=FlowMatchSampler(num_steps=4, guidance_scale=3.0),
                      grpo=GRPOArgs(num_samples_per_prompt=2, timestep_fraction=1.0),
                      run=RunArgs(frames=SIZE.frames, height=SIZE.height, width=SIZE.width))
    quick_trainer(max_steps=1, default_root_dir=tmp_path, callbacks=[parity, snapshot]).fit(
        module, SyntheticVideos(num_samples=2, batch_size=2, frames=SIZE.frames, height=SIZE.height,
                                width=SIZE.width))
    assert parity.checks == 1 and parity.last_gap < 1e-5
    after = module.card["transformer"].state_dict()
    assert any(not torch.equal(snapshot.before[k], after[k]) for k in snapshot.before)


def test_diffusion_nft_image_to_video_trains_and_keeps_its_old_copy_behind(tmp_path, one_thread):
    """DiffusionNFT in image-to-video (each clip's first frame, K = 2 rows per prompt): two iterations move the
    transformer, and its ``old`` copy, blended toward it after each step, is a version behind and not equal."""
    snapshot = Snapshot()
    module = DiffusionNFT(ti2v_card("wan22_ti2v_i2v", lr=1e-2), reward=ColourAlignment(),
                          sampler=FlowMatchSampler(num_steps=4), grpo=GRPOArgs(num_samples_per_prompt=2),
                          run=RunArgs(frames=SIZE.frames, height=SIZE.height, width=SIZE.width))
    quick_trainer(max_steps=2, default_root_dir=tmp_path, callbacks=[snapshot]).fit(
        module, SyntheticVideos(num_samples=4, batch_size=2, frames=SIZE.frames, height=SIZE.height,
                                width=SIZE.width))
    card = module.card
    after = card["transformer"].state_dict()
    assert card.versions["transformer"] == 2
    assert any(not torch.equal(snapshot.before[k], after[k]) for k in snapshot.before)
    old = card.models[module.old].state_dict()
    assert any(not torch.equal(old[k], after[k]) for k in after)


@pytest.mark.parametrize("arch", ["wan22_ti2v", "wan22_ti2v_i2v"])
def test_finetune_trains_one_iteration_each_way(arch, tmp_path, one_thread):
    """One finetune iteration on synthetic clips: text-to-video, and image-to-video from each clip's first frame."""
    module = Finetune(ti2v_card(arch, lr=1e-2), sampler=FlowMatchSampler(num_steps=2), caption_dropout=0.0,
                      run=RunArgs(frames=SIZE.frames, height=SIZE.height, width=SIZE.width))
    assert module.stage.takes_image is (arch == "wan22_ti2v_i2v")
    snapshot = Snapshot()
    quick_trainer(max_steps=1, default_root_dir=tmp_path, callbacks=[snapshot]).fit(
        module, SyntheticVideos(num_samples=2, batch_size=2, frames=SIZE.frames, height=SIZE.height,
                                width=SIZE.width))
    after = module.card["transformer"].state_dict()
    assert any(not torch.equal(snapshot.before[k], after[k]) for k in snapshot.before)


def distill_card(arch: str = "wan22_ti2v", lr: float = 1e-3) -> ModelCard:
    """DMD2's experts on TI2V: UMT5, the Wan 2.2 VAE and the teacher frozen; the student (``transformer``) and the
    critic trainable, both started from the teacher (``init_from``)."""
    def trained() -> Expert:
        return Expert(arch=arch, trainable=True, optimizer=adamw(lr), init_from="teacher")

    return ModelCard({"text_encoder": Expert(arch="umt5"), "vae": Expert(arch="wan22_vae"),
                      "teacher": Expert(arch=arch), "transformer": trained(), "critic": trained()}, text_max_length=32)


def test_joint_rl_trains_a_refiner_and_the_text_to_video_generator(one_thread):
    """Joint RL with TI2V text-to-video: one tiny Qwen2 refiner appends to each request, the generator reads its text
    through UMT5 with one timestep per token, one reward (ColourAlignment) scores the K = 4 clips of each request; one
    iteration steps both with log-probability parity (the generator's SDE steps and the refiner's tokens)."""
    from posttrain.lit.joint_rl import JointRL
    from posttrain.modules.rl.refiner_args import RefinerArgs

    torch.manual_seed(0)
    card = ModelCard({"text_encoder": Expert(arch="umt5"), "vae": Expert(arch="wan22_vae"),
                      "transformer": Expert(arch="wan22_ti2v", trainable=True, optimizer=adamw(1e-3))},
                     num_refiners=1, refiner=Expert(arch="qwen2", trainable=True, optimizer=adamw(2e-2)),
                     text_max_length=48)
    module = JointRL(card, FlowMatchSampler(num_steps=3), reward=ColourAlignment(),
                     grpo=GRPOArgs(num_samples_per_prompt=4, timestep_fraction=1.0),
                     refiners=RefinerArgs(max_new_tokens=8, mode="append", num_unrefined=1),
                     run=RunArgs(frames=SIZE.frames, height=SIZE.height, width=SIZE.width))
    joint_rl_steps_refiner_and_generator(module, PROMPTS)


def test_dmd2_distills_a_text_to_video_student(one_thread):
    """DMD2 on TI2V text-to-video (a 2-step student, the teacher's CFG 4.5 as the real score, one timestep per token
    everywhere, the student stepping every iteration): two iterations step student and critic twice each and move
    both, the teacher stays bit for bit at version 0, and both losses are finite."""
    torch.manual_seed(0)  # the random tiny teacher
    card = distill_card()
    module = DMD2(card, student_steps=2, generator_update_ratio=1,
                  teacher_sampler=FlowMatchSampler(num_steps=4, guidance_scale=4.5),
                  run=RunArgs(frames=SIZE.frames, height=SIZE.height, width=SIZE.width))
    dmd2_steps_student_and_critic_twice(module, PROMPTS)


@pytest.mark.parametrize("terms", ["dmd", "regression_gan_no_backward_simulation"])
def test_dmd2_distills_an_image_to_video_student(terms, monkeypatch, one_thread):
    """DMD2 image-to-video (student, critic and teacher ``wan22_ti2v_i2v``, batches of captioned clips whose first
    frames condition every sample and score): two iterations step student and critic twice each and move both, the
    teacher stays bit for bit at version 0, and every forward of any of the three (the real score's empty-prompt
    pass included) reads a first frame. With the regression and GAN terms on and the exit step fed a noised teacher
    sample, the teacher's pairs are its samples from each row's first frame as well as its prompt."""
    adapter = presets.architecture("wan22_ti2v_i2v").adapter
    real_velocity, frames = adapter.velocity, []

    def velocity(transformer, x, timestep, cond, **kwargs):
        frames.append(cond.get("first_frame_latents") is not None)
        return real_velocity(transformer, x, timestep, cond, **kwargs)

    monkeypatch.setattr(adapter, "velocity", velocity)
    torch.manual_seed(0)  # the random tiny teacher
    card = distill_card("wan22_ti2v_i2v")
    others = {} if terms == "dmd" else dict(
        backward_simulation=False, regression=RegressionArgs(weight=0.5, pairs=2),
        gan=GANArgs(generator_weight=0.1, critic_weight=0.1))
    module = DMD2(card, student_steps=2, generator_update_ratio=1,
                  teacher_sampler=FlowMatchSampler(num_steps=4, guidance_scale=4.5),
                  run=RunArgs(frames=SIZE.frames, height=SIZE.height, width=SIZE.width), **others)
    data = SyntheticVideos(num_samples=4, frames=SIZE.frames, height=SIZE.height, width=SIZE.width, batch_size=2)
    dmd2_steps_student_and_critic_twice(module, PROMPTS, data)
    assert frames and all(frames), f"{frames.count(False)} of {len(frames)} forwards without the first frame"
    if terms == "dmd":
        return
    keys = list(module._teacher_bank)  # (prompt, pair, first frame's digest): every row's image, both pairs
    assert keys and all(image for _, _, image in keys) and {j for _, j, _ in keys} <= {0, 1}


def test_dmd2_refuses_a_text_to_video_student_of_an_image_to_video_teacher():
    """Student, critic and teacher generate alike: a text-to-video student with image-to-video critic and teacher is
    refused before anything is built, naming each."""
    card = distill_card("wan22_ti2v_i2v")
    card.specs["transformer"] = Expert(arch="wan22_ti2v", trainable=True, optimizer=adamw(), init_from="teacher")
    with pytest.raises(ValueError, match=r"'critic' \(the fake score\) has arch 'wan22_ti2v_i2v'; it must be a generator "
                                         r"run like 'transformer' \('wan22_ti2v'\)(.|\n)*'teacher' \(the real score\)"):
        DMD2(card, run=RunArgs(frames=SIZE.frames, height=SIZE.height, width=SIZE.width))


def test_dmd2_image_to_video_scores_and_samples_read_the_first_frame(one_thread):
    """The teacher's pairs and the served student's samples hold each row's first frame (its latents, bit for bit),
    one prompt with two images gives two teacher samples, and the same image gives the same pair again."""
    torch.manual_seed(0)
    module = DMD2(distill_card("wan22_ti2v_i2v"), student_steps=2,
                  teacher_sampler=FlowMatchSampler(num_steps=4, guidance_scale=4.5),
                  run=RunArgs(frames=SIZE.frames, height=SIZE.height, width=SIZE.width))
    module.configure_model()
    module.eval()
    clips = videos()
    images = clips[:, :, 0]
    first = module.stage.condition(PROMPTS, images=images, size=SIZE)["first_frame_latents"]
    prompt = [PROMPTS[0], PROMPTS[0]]
    noise, sample = module.teacher_pairs(prompt, [0, 0], {"images": images})
    one_by_one = torch.cat([module.stage.condition(prompt[:1], images=images[i:i + 1], size=SIZE)["first_frame_latents"]
                            for i in range(2)])  # the bank draws a row at a time (the VAE's rounding differs batched)
    assert torch.equal(sample[:, :, :1], one_by_one.to(sample))
    assert (sample[0, :, 1:] - sample[1, :, 1:]).abs().max() > 1e-3  # each image's own sample
    again = module.teacher_pairs(prompt, [0, 0], {"images": images})
    assert torch.equal(again[0], noise) and torch.equal(again[1], sample)
    served = module.generate(PROMPTS, seed=3, latents_only=True, images=images)
    assert torch.equal(served[:, :, :1], first.to(served))


@pytest.mark.slow
def test_the_image_to_video_student_comes_closer_to_the_teacher(tmp_path):
    """configs/dmd2_wan22_ti2v.yaml with one student step for 300 iterations: the one-step student's samples of 16
    seen-concept prompts, each from the first frame of a clip of it, come closer to the teacher's samples (20 steps,
    CFG 4.5) from the same frames and noise than the teacher's weights run in one step (the zero-student-lr control:
    ``test_zero_student_lr_leaves_the_student_bitwise_while_the_critic_trains``): the Fréchet VAE distance and the
    latent MSE fall (measured here: Fréchet 0.057 -> 0.025, latent MSE 0.100 -> 0.082; on 32 held-out prompts over 3
    seeds, Fréchet 0.023 -> 0.011 [0.010, 0.012]: docs/distill/dmd2.md#image-to-video)."""
    from tests.test_dmd2 import fit_and_measure

    _, before, after, _ = fit_and_measure("configs/dmd2_wan22_ti2v.yaml", tmp_path, 300,
                                          "--model.init_args.student_steps", "1")
    assert after["frechet"] < 0.75 * before["frechet"] and after["latent_mse"] < before["latent_mse"], (before, after)
    assert after["colour"] == after["background"] == 1.0, after  # the first frame's facts stay


def cached_clips(tmp_path) -> VideoFolder:
    """Two captioned clips (an mp4 and a gif) in a VideoFolder with a ``latents_cache``: batches of latents, no pixels."""
    root = tmp_path / "clips"
    root.mkdir()
    for name, colour in (("a.mp4", "red"), ("b.gif", "yellow")):
        caption(clip(root / name, frames=SIZE.frames, height=SIZE.height, width=SIZE.width, colour=colour),
                f"a {colour} circle moving right")
    return VideoFolder(str(root), frames=SIZE.frames, height=SIZE.height, width=SIZE.width,
                       latents_cache=str(tmp_path / "latents"), batch_size=2)


def test_image_to_video_finetunes_from_a_latents_cache(tmp_path, one_thread):
    """Image-to-video from a VideoFolder ``latents_cache`` (batches carry ``latents``, no pixels): each row is
    conditioned on its clip's first latent frame, which is the conditioning its first pixel frame gives (the Wan 2.2
    VAE is causal in time: bit for bit when each frame is encoded alone, as the cache encodes each clip; 4.8e-7 with
    both frames in one batch, float32 CPU), and a finetune iteration on those batches moves the transformer.
    Wan I2V, whose conditioning is the VAE latents of [image, 0, …, 0], still refuses latents with its error."""
    torch.manual_seed(0)
    module = Finetune(ti2v_card("wan22_ti2v_i2v", lr=1e-2), sampler=FlowMatchSampler(num_steps=2), caption_dropout=0.0,
                      run=RunArgs(frames=SIZE.frames, height=SIZE.height, width=SIZE.width))
    data = cached_clips(tmp_path)
    snapshot = Snapshot()
    quick_trainer(max_steps=1, default_root_dir=tmp_path, callbacks=[snapshot]).fit(module, data)
    after = module.card["transformer"].state_dict()
    assert any(not torch.equal(snapshot.before[k], after[k]) for k in snapshot.before)

    items = [data.train_dataset()[i] for i in range(2)]  # what the loader batches: latents (cached by the card's VAE)
    assert all("latents" in item and "video" not in item for item in items)
    prompts = [item["prompt"] for item in items]
    batch = {"latents": torch.stack([item["latents"] for item in items]), "prompt": prompts}
    from_latents = module.condition_batch(batch, prompts, module.video)["first_frame_latents"]  # (2, 48, 1, 4, 4)
    images = torch.stack([FolderDataset(data.train_entries).video(i) for i in range(2)])[:, :, 0]
    # each first frame through the VAE alone, as the cache encoded each clip: the same bits
    one_by_one = torch.cat([module.stage.condition(prompts[i:i + 1], images=images[i:i + 1], size=SIZE)
                            ["first_frame_latents"] for i in range(2)])
    assert from_latents.shape == (2, 48, 1, 4, 4) and torch.equal(from_latents, one_by_one)
    # both in one batch: the convolutions' rounding at another batch size
    batched = module.stage.condition(prompts, images=images, size=SIZE)["first_frame_latents"]
    gap = (from_latents - batched).abs().max().item()
    print(f"TI2V image-to-video conditioning, cached latents vs the first frames as a batch: max |Δ| = {gap:.1e}")
    assert gap < 1e-5

    wan_i2v = Finetune(i2v_card(), run=RunArgs(frames=5, height=16, width=16))
    with pytest.raises(ValueError, match=r"WanI2V \('transformer'\) generates from a first frame and reads none off "
                                         r"precomputed latents \(Wan 2.2 TI2V does: `arch: wan22_ti2v_i2v`\)"):
        wan_i2v.condition_batch({"latents": torch.zeros(2, 16, 2, 4, 4), "prompt": prompts}, prompts, wan_i2v.video)


@pytest.mark.parametrize("method", ["flow_grpo", "diffusion_nft"])
def test_rl_rolls_out_image_to_video_from_a_latents_cache(tmp_path, method, one_thread):
    """FlowGRPO and DiffusionNFT in image-to-video on a VideoFolder ``latents_cache`` (batches carry ``latents``, no
    pixels): each rollout starts from its clip's first latent frame, which the samples keep exactly (the sampler
    holds it clean), and an iteration moves the transformer (FlowGRPO with its log-probability check raising)."""
    torch.manual_seed(0)
    run = RunArgs(frames=SIZE.frames, height=SIZE.height, width=SIZE.width)
    if method == "flow_grpo":
        module = FlowGRPO(ti2v_card("wan22_ti2v_i2v", lr=1e-2), reward=ColourAlignment(), run=run,
                          sampler=FlowMatchSampler(num_steps=4, guidance_scale=3.0),
                          grpo=GRPOArgs(num_samples_per_prompt=2, timestep_fraction=1.0))
        callbacks = [LogProbParityCheck(tolerance=1e-5, on_violation="raise")]
    else:
        module = DiffusionNFT(ti2v_card("wan22_ti2v_i2v", lr=1e-2), reward=ColourAlignment(), run=run,
                              sampler=FlowMatchSampler(num_steps=4), grpo=GRPOArgs(num_samples_per_prompt=2))
        callbacks = []
    data = cached_clips(tmp_path)
    snapshot = Snapshot()
    quick_trainer(max_steps=1, default_root_dir=tmp_path, callbacks=[snapshot, *callbacks]).fit(module, data)
    after = module.card["transformer"].state_dict()
    assert any(not torch.equal(snapshot.before[k], after[k]) for k in snapshot.before)
    if callbacks:
        assert callbacks[0].checks == 1 and callbacks[0].last_gap < 1e-5

    items = [data.train_dataset()[i] for i in range(2)]
    batch = {"latents": torch.stack([item["latents"] for item in items]), "prompt": [item["prompt"] for item in items]}
    first = module.first_frames(batch)
    assert set(first) == {"latents"}
    samples = module.generate(batch["prompt"], seed=3, latents_only=True, **first)  # (2, 48, 3, 4, 4)
    assert torch.equal(samples[:, :, :1], batch["latents"][:, :, :1])
    assert not torch.equal(samples[:, :, 1:], batch["latents"][:, :, 1:])


class Snapshot(Callback):
    """The transformer's weights when training starts (the card builds them in setup)."""

    def on_train_start(self, trainer, pl_module):
        self.before = {k: v.clone() for k, v in pl_module.card["transformer"].state_dict().items()}


def finetuned(tmp_path, arch: str, guidance: float, scheduler=None):
    """Two finetune iterations (lr 1e-2, EMA 0.9, 4 sampler steps) of the tiny TI2V and the checkpoint."""
    return export_finetuned(tmp_path, ti2v_card(arch, lr=1e-2),
                            RunArgs(frames=SIZE.frames, height=SIZE.height, width=SIZE.width), guidance, scheduler)


def test_text_to_video_export_reproduces_predict(tmp_path, one_thread):
    """WanPipeline (expand_timesteps=True) on the exported folder, CFG 3 with the empty negative prompt, the same
    noise: max |Δ latents| < 1e-4 and the same pixels."""
    module, ckpt = finetuned(tmp_path, "wan22_ti2v", guidance=3.0)
    out = export(ckpt, str(tmp_path / "pipe"))
    pipe = WanPipeline.from_pretrained(out)
    assert pipe.config.expand_timesteps and pipe.vae.config.z_dim == 48
    call = json.load(open(os.path.join(out, "serving.json")))
    assert call.pop("pipeline") == "WanPipeline" and call.pop("transformer") == "transformer_ema"

    ours = module.generate(PROMPTS, seed=7, latents_only=True)  # (2, 48, 3, 4, 4)
    noise = torch.randn((len(PROMPTS), *module.stage.latent_shape(module.video)),
                        generator=torch.Generator().manual_seed(7))
    theirs = pipe(PROMPTS, latents=noise, output_type="latent", **call).frames
    gap = (ours - theirs).abs().max().item()
    print(f"WanPipeline (expand_timesteps) vs predict, cfg 3: max |Δ latents| = {gap:.2e}")
    assert gap < 1e-4
    pixels = pipe(PROMPTS, latents=noise, output_type="pt", **call).frames  # (B, F, 3, H, W) in [0, 1]
    assert ((module.stage.decode(ours) + 1) / 2 - pixels.permute(0, 2, 1, 3, 4)).abs().max() < 1e-4


@pytest.mark.parametrize("scheduler", ["euler", "unipc"])
def test_image_to_video_export_reproduces_predict(tmp_path, scheduler, one_thread):
    """WanImageToVideoPipeline (expand_timesteps=True, no image encoder) on the exported folder, given the same
    noise and first frame (a [0, 1] tensor its video processor maps to [-1, 1]), CFG 3: max |Δ latents| < 1e-4, with
    the first latent frame the image's. The pipeline takes one image per call, so each sample runs on its own.
    ``unipc``: the published folder's scheduler (UniPC, flow shift 5)."""
    from diffusers import UniPCMultistepScheduler

    unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    module, ckpt = finetuned(tmp_path, "wan22_ti2v_i2v", guidance=3.0,
                             scheduler=unipc if scheduler == "unipc" else None)
    out = export(ckpt, str(tmp_path / "pipe"))
    pipe = WanImageToVideoPipeline.from_pretrained(out)
    assert pipe.config.expand_timesteps and pipe.image_encoder is None
    call = json.load(open(os.path.join(out, "serving.json")))
    assert call.pop("pipeline") == "WanImageToVideoPipeline"
    call.pop("transformer")

    images = videos()[:, :, 0]  # (2, 3, 64, 64) in [-1, 1]
    ours = module.generate(PROMPTS, seed=3, latents_only=True, images=images)
    assert torch.equal(ours[:, :, :1], module.stage.condition(PROMPTS, images=images, size=module.video)
                       ["first_frame_latents"])
    noise = torch.randn((len(PROMPTS), *module.stage.latent_shape(module.video)),
                        generator=torch.Generator().manual_seed(3))
    gaps = []
    for b in range(len(PROMPTS)):
        theirs = pipe(prompt=PROMPTS[b], image=(images[b:b + 1] + 1) / 2, latents=noise[b:b + 1],
                      output_type="latent", **call).frames
        gaps.append((ours[b:b + 1] - theirs).abs().max().item())
    print(f"WanImageToVideoPipeline (expand_timesteps, {scheduler}) vs predict, cfg 3: max |Δ latents| = "
          f"{max(gaps):.2e}")
    assert max(gaps) < 1e-4


def test_image_to_video_lora_exports_in_both_formats(tmp_path, one_thread):
    """A LoRA (rank 4, attention and FFN) trained image-to-video exports as its adapter beside the base pipeline;
    ``WanImageToVideoPipeline.load_lora_weights`` reads both files (PEFT keys, and the original Wan names that TI2V's
    checkpoint shares with Wan 2.1 and diffusers converts) and reproduces the package's sample with the same
    (bfloat16) adapter: max |Δ latents| < 1e-4."""
    card = ti2v_card("wan22_ti2v_i2v", lr=1e-2)
    card.specs["transformer"].lora = LoraConfig(rank=4, alpha=8.0, target_modules=[
        "to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"])
    module = Finetune(card, sampler=FlowMatchSampler(num_steps=4), caption_dropout=0.0,
                      run=RunArgs(frames=SIZE.frames, height=SIZE.height, width=SIZE.width))
    trainer = quick_trainer(max_steps=2, default_root_dir=tmp_path)
    trainer.fit(module, SyntheticVideos(num_samples=4, batch_size=2, frames=SIZE.frames, height=SIZE.height,
                                        width=SIZE.width))
    with torch.no_grad():  # the files are bfloat16: compare with the same adapter
        for name, param in module.card["transformer"].named_parameters():
            if "lora_" in name:
                param.copy_(param.bfloat16().float())
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    out = export(str(tmp_path / "run.ckpt"), str(tmp_path / "pipe"), with_base=True)
    assert {"pytorch_lora_weights.safetensors", "comfyui_lora.safetensors"} <= set(os.listdir(out))
    pipe = WanImageToVideoPipeline.from_pretrained(out)
    images = videos()[:1, :, 0]
    ours = module.eval().generate(PROMPTS[:1], seed=5, latents_only=True, images=images)
    noise = torch.randn(ours.shape, generator=torch.Generator().manual_seed(5))
    call = {k: v for k, v in json.load(open(os.path.join(out, "serving.json"))).items()
            if k not in ("pipeline", "transformer")}

    def theirs() -> torch.Tensor:
        return pipe(prompt=PROMPTS[0], image=(images + 1) / 2, latents=noise, output_type="latent", **call).frames

    assert (theirs() - ours).abs().max() > 1e-3  # the base alone: the adapter matters
    for file in ("pytorch_lora_weights.safetensors", "comfyui_lora.safetensors"):
        pipe.load_lora_weights(out, weight_name=file)
        gap = (theirs() - ours).abs().max().item()
        print(f"WanImageToVideoPipeline.load_lora_weights({file}) vs predict: max |Δ latents| = {gap:.2e}")
        assert gap < 1e-4
        pipe.unload_lora_weights()


@pytest.mark.parametrize("config", ["finetune_wan22_ti2v.yaml", "flow_grpo_wan22_ti2v.yaml", "dmd2_wan22_ti2v.yaml"])
def test_configs_train_one_iteration(config, tmp_path):
    """The shipped configs through the command (in this process): one finetune / FlowGRPO iteration, a checkpoint."""
    fit_shipped_config_once(config, tmp_path / "run")


def test_published_5b_builds_on_meta_with_its_parameter_count():
    """Wan2.2-TI2V-5B at real size (meta device): the transformer 5.00e9 parameters (the published "5B"), the same
    for either task's arch; the Wan 2.2 VAE 0.70e9 (48 latent channels); UMT5-XXL as Wan 2.1's."""
    counts = {(arch, sub): sum(p.numel() for p in presets.build_model(
        arch, subfolder=sub, published="Wan2.2-TI2V-5B", device="meta").parameters())
        for arch, sub in [("wan22_ti2v", "transformer"), ("wan22_ti2v_i2v", "transformer"), ("wan22_vae", "vae")]}
    assert counts == {("wan22_ti2v", "transformer"): 4_999_787_712, ("wan22_ti2v_i2v", "transformer"): 4_999_787_712,
                      ("wan22_vae", "vae"): 704_688_668}


def test_activation_estimate_matches_a_real_forward(tmp_path):
    """``posttrain estimate`` on configs/finetune_wan22_ti2v.yaml (3 blocks, 2 rows of 9 x 64 x 64 clips, one timestep
    per token) against the bytes a real forward saves for backward."""
    shipped_config_estimate_matches_a_real_forward(tmp_path, "finetune_wan22_ti2v.yaml", "wan22_ti2v_i2v",
                                                   {"num_layers": 3})
