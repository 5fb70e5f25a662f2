"""Workflows served: prompts → FLUX image → Wan I2V video, outputs threaded between stages; bad chains refused."""
from __future__ import annotations

import os

import pytest
import torch
import yaml

from posttrain.lit.tools.config import PosttrainCLI
from posttrain.lit.workflow import Workflow
from posttrain.modules.models.cards import Expert, ModelCard
from posttrain.modules.flow.samplers import FlowMatchSampler
from posttrain.modules.rl.workflow import Stage
from tests.conftest import workflow_experts

PROMPTS = ["a red circle moving left on a blue background", "a yellow square moving down on a green background"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.usefixtures("one_thread")


def stages(t2i: dict | None = None, i2v: dict | None = None) -> list[Stage]:
    """A 16x16 FLUX image stage and a 5x16x16 I2V stage, 4 sampler steps each (``t2i``/``i2v`` override)."""
    return [Stage("t2i", **{"sampler": FlowMatchSampler(4), "frames": 1, "height": 16, "width": 16, **(t2i or {})}),
            Stage("i2v", **{"sampler": FlowMatchSampler(4), "frames": 5, "height": 16, "width": 16, **(i2v or {})})]


def workflow(experts=None, stage_list=None, **card_kwargs) -> Workflow:
    card = ModelCard(experts or workflow_experts(t2i_trainable=False, i2v_trainable=False), text_max_length=32,
                     **card_kwargs)
    return Workflow(card, stage_list or stages())


def test_the_video_depends_on_the_image():
    """The I2V stage animates the T2I stage's image: another T2I seed gives another image and another video
    (the I2V noise held fixed); the same seeds give the same outputs bitwise."""
    wf = workflow()
    wf.configure_model()
    a = wf.run_stages(PROMPTS, seeds={"t2i": 1, "i2v": 5})
    b = wf.run_stages(PROMPTS, seeds={"t2i": 1, "i2v": 5})
    c = wf.run_stages(PROMPTS, seeds={"t2i": 2, "i2v": 5})
    assert a["t2i"].media.shape == (2, 3, 1, 16, 16) and a["i2v"].media.shape == (2, 3, 5, 16, 16)
    assert torch.equal(a["t2i"].media, b["t2i"].media) and torch.equal(a["i2v"].media, b["i2v"].media)
    assert (a["t2i"].media - c["t2i"].media).abs().max() > 1e-3
    assert (a["i2v"].media - c["i2v"].media).abs().max() > 1e-3  # only the image changed
    # the I2V stage alone: same noise and prompts, other conditioning image -> other video
    gen = wf.plan.generators["i2v"]
    noise = torch.randn((2, *gen.latent_shape(stages()[1].size)), generator=torch.Generator().manual_seed(0))
    videos = []
    for image in (a["t2i"].media[:, :, 0], c["t2i"].media[:, :, 0]):
        cond = gen.condition(PROMPTS, images=image, size=stages()[1].size)
        videos.append(gen.sample(FlowMatchSampler(4), noise, cond).latents)
    assert (videos[0] - videos[1]).abs().max() > 1e-3


def test_conditioning_rows_stay_paired():
    """A conditioning selects every tensor together: row j's image latents stay with row j's text."""
    wf = workflow()
    wf.configure_model()
    gen = wf.plan.generators["i2v"]
    images = torch.stack([torch.full((3, 16, 16), v) for v in (-0.8, 0.0, 0.8)])
    cond = gen.condition(PROMPTS + ["a green triangle moving up on a red background"], images=images,
                         size=stages()[1].size)
    assert set(cond) == {"encoder_hidden_states", "image_latents"}
    # (B, T + C, F', h, w): the first-frame mask (T = the VAE's temporal factor) then the image latents
    temporal = gen.card[gen.vae].config.scale_factor_temporal
    assert cond["image_latents"].shape[:3] == (3, temporal + 16, 2)
    assert torch.equal(cond["image_latents"][:, :temporal, 0], torch.ones_like(cond["image_latents"][:, :temporal, 0]))
    assert not cond["image_latents"][:, :temporal, 1:].any()
    picked = cond.select(torch.tensor([2, 0]))
    assert torch.equal(picked["image_latents"], cond["image_latents"][[2, 0]])
    assert torch.equal(picked["encoder_hidden_states"], cond["encoder_hidden_states"][[2, 0]])
    flux = wf.plan.generators["t2i"].condition(PROMPTS)
    assert flux["encoder_hidden_states"].shape == (2, 32, 32) and flux["pooled_projections"].shape == (2, 32)


@pytest.mark.parametrize("experts, stage_list, message", [
    (None, [Stage("i2v", frames=5, height=16, width=16)],
     r"stages\[0\] \(i2v\): WanI2V \('i2v_transformer'\) animates an image, but no stage before it makes one: "
     r"put an image stage \(e.g. FLUX, frames: 1\) before it"),
    (None, stages(i2v={"height": 32, "width": 32}),
     r"stages\[1\] \(i2v\) makes 32x32 videos from stages\[0\] \(t2i\)'s 16x16 images: give both stages the same "
     r"height and width"),
    (workflow_experts(t2i_trainable=False, i2v_trainable=False, drop=("t2i_text_encoder_2",)), None,
     r"stages\[0\] \(t2i\): the card has no 't2i_text_encoder_2': Flux \('t2i_transformer'\) reads it as its "
     r"text_encoder_2; add `t2i_text_encoder_2: \{arch: t5\}` to card.experts"),
    (None, stages(t2i={"frames": 5}),
     r"stages\[1\] \(i2v\) takes an image, but stages\[0\] \(t2i\) makes 5-frame videos: set its frames: 1"),
    ({**workflow_experts(t2i_trainable=False, i2v_trainable=False),
      "v_text_encoder": Expert(arch="umt5"), "v_vae": Expert(arch="wan_vae"), "v_transformer": Expert(arch="wan_t2v")},
     stages() + [Stage("v", frames=5, height=16, width=16)],
     r"stages\[2\] \(v\): WanT2V reads no image, so stages\[1\] \(i2v\)'s output would be dropped"),
])
def test_chains_that_cannot_feed_are_refused(experts, stage_list, message):
    with pytest.raises(ValueError, match=message):
        workflow(experts, stage_list)


def test_refiners_must_come_before_the_generators():
    experts = workflow_experts(t2i_trainable=False, i2v_trainable=False)
    refiner = Expert(arch="qwen2")
    with pytest.raises(ValueError, match=r"stages\[1\] \(refine\) refines prompts after generator stage 't2i'"):
        workflow(experts, [stages()[0], Stage("refine", kind="refiners"), stages()[1]], num_refiners=1,
                 refiner=refiner)
    wf = workflow(experts, [Stage("refine", kind="refiners", max_new_tokens=4), *stages()], num_refiners=1,
                  refiner=refiner)
    wf.configure_model()
    out = wf.run_stages(PROMPTS, seed=0)
    assert out["refine"].prompts[0].startswith(PROMPTS[0]) and out["i2v"].media.shape[2] == 5


@pytest.mark.slow
def test_predict_writes_images_and_videos(tmp_path):
    """`posttrain predict` on the workflow config: one PNG per prompt from the FLUX stage and the video the
    I2V stage made from it, side by side under the stage folders."""
    out = tmp_path / "outputs"
    config = yaml.safe_load(open(os.path.join(ROOT, "configs", "workflow_t2i_i2v.yaml")))
    for stage in config["model"]["init_args"]["stages"]:
        stage["sampler"]["init_args"]["num_steps"] = 2  # a quick run of the same config
    (tmp_path / "quick.yaml").write_text(yaml.safe_dump(config))
    cli = PosttrainCLI(args=["predict", "--config", str(tmp_path / "quick.yaml"), "--trainer.logger=false",
                             f"--trainer.default_root_dir={tmp_path}", f"--trainer.callbacks.output_dir={out}",
                             "--data.init_args.num_synthetic=2", "--data.init_args.batch_size=2"])
    assert isinstance(cli.model, Workflow)
    images, videos = sorted(os.listdir(out / "t2i")), sorted(os.listdir(out / "i2v"))
    assert len(images) == 2 and all(f.endswith(".png") for f in images)
    assert [f[:-4] for f in videos] == [f[:-4] for f in images] and all(f.endswith(".mp4") for f in videos)
