"""Every method on the new generators: FLUX text-to-image and Wan image-to-video, through the one sampler.

Learning is asserted against a control: an I2V finetune makes the generated first frame match the
conditioning image (PSNR, torchmetrics) far better than the untrained generator; Flow-GRPO on FLUX raises
its reward where a constant reward changes nothing. Bad input stops with the option and the fix.
"""
from __future__ import annotations

import pytest
import torch
from torchmetrics.functional.image import peak_signal_noise_ratio

from posttrain.datamodules.prompts import Prompts
from posttrain.datamodules.synthetic import ShapesDataset, SyntheticVideos
from posttrain.lit.base import RunArgs
from posttrain.lit.diffusion_nft import DiffusionNFT
from posttrain.lit.finetune import Finetune
from posttrain.lit.flow_grpo import FlowGRPO
from posttrain.lit.joint_rl import JointRL
from posttrain.modules.models import vae as codec
from posttrain.modules.models.cards import Expert, ModelCard
from posttrain.modules.rl.grpo import GRPOArgs
from posttrain.modules.rl.refiner_args import RefinerArgs
from posttrain.modules.rewards.synthetic import ColourAlignment, MotionAlignment
from posttrain.modules.rewards.base import ConstantReward, score
from posttrain.modules.flow.samplers import FlowMatchSampler
from tests.conftest import adamw, flux_card, i2v_card
from tests.helpers import quick_trainer

PROMPTS = ["a red circle moving left on a blue background", "a yellow square moving down on a green background"]
# a small random I2V, quick to finetune; patch 1 so that a 32 px frame is more than a few tokens
TINY_WAN = dict(num_attention_heads=2, ffn_dim=128, num_layers=2, patch_size=(1, 1, 1))

pytestmark = pytest.mark.usefixtures("one_thread")


def held_out(n: int, size: RunArgs) -> tuple[torch.Tensor, list[str]]:
    """First frames and captions of ``n`` synthetic videos the finetune never sees (another seed)."""
    data = ShapesDataset(n, size.frames, size.height, size.width, seed=99)
    return torch.stack([data[i]["video"][:, 0] for i in range(n)]), [data[i]["prompt"] for i in range(n)]


def first_frame_psnr(module: Finetune, images: torch.Tensor, prompts: list[str]) -> float:
    videos = module.generate(prompts, seed=0, images=images)
    return float(peak_signal_noise_ratio((videos[:, :, 0] + 1) / 2, (images + 1) / 2, data_range=1.0))


@pytest.mark.slow
def test_i2v_finetune_makes_the_first_frame_the_image():
    """120 finetune iterations of a random Wan I2V on synthetic videos, each conditioned on its own first
    frame: the generated first frame matches the conditioning image (PSNR on 8 unseen images) far better
    than the untrained control's, and better than a frame of the image's mean colour (so it copies the
    shape, not only the colours). Measured: 6.5 dB -> 15.3 dB, mean colour 12.9 dB, the VAE's own
    reconstructions 17.4 dB (main's tiny 8x VAE at 32 px)."""
    torch.manual_seed(0)
    size = RunArgs(frames=5, height=32, width=32)
    card = i2v_card(lr=3e-3)
    card.specs["transformer"].preset = dict(TINY_WAN)
    module = Finetune(card, sampler=FlowMatchSampler(num_steps=8), caption_dropout=0.0, run=size)
    module.configure_model()
    images, prompts = held_out(8, size)
    control = first_frame_psnr(module, images, prompts)
    quick_trainer(120).fit(module, SyntheticVideos(num_samples=256, batch_size=4, frames=5, height=32, width=32))
    module.eval()
    trained = first_frame_psnr(module, images, prompts)
    flat = images.mean(dim=(2, 3), keepdim=True).expand_as(images)
    mean_colour = float(peak_signal_noise_ratio((flat + 1) / 2, (images + 1) / 2, data_range=1.0))
    print(f"I2V first frame vs conditioning image: PSNR {control:.2f} dB (untrained) -> {trained:.2f} dB "
          f"(mean colour {mean_colour:.2f} dB)")
    assert trained > control + 6.0, (control, trained)
    assert trained > mean_colour + 1.0, (mean_colour, trained)


@pytest.mark.slow
def test_flux_flow_grpo_raises_its_reward_against_a_constant_reward():
    """Flow-GRPO on FLUX (images, FLUX's mu-shifted σ grid): the colour reward of fixed-seed ODE samples
    rises; with a constant reward (zero advantage) the same run leaves the weights bitwise unchanged."""
    from tests.test_export_generators import flux_scheduler

    def make(reward):
        # a random FLUX of the world's size (a preset key set: not the trained asset)
        return FlowGRPO(flux_card(lr=1e-3, transformer_preset={"num_layers": 2}),
                        sampler=FlowMatchSampler(num_steps=8, scheduler=flux_scheduler()),
                        reward=reward, grpo=GRPOArgs(num_samples_per_prompt=4, timestep_fraction=1.0, kl_beta=0.004),
                        run=RunArgs(frames=1, height=32, width=32))

    def eval_reward(model) -> float:
        model.eval()
        return score(ColourAlignment(), model.generate(PROMPTS, seed=123), PROMPTS).total.mean().item()

    torch.manual_seed(0)
    model = make(ColourAlignment())
    model.configure_model()
    before = eval_reward(model)
    quick_trainer(30).fit(model, Prompts(prompts=PROMPTS, batch_size=2))
    after = eval_reward(model)

    control = make(ConstantReward(0.5))
    control.configure_model()
    weights0 = {k: v.clone() for k, v in control.card["transformer"].state_dict().items()}
    quick_trainer(3).fit(control, Prompts(prompts=PROMPTS, batch_size=2))
    print(f"flow_grpo on FLUX: colour reward {before:.4f} -> {after:.4f}")
    assert after > before + 1e-2, (before, after)
    assert all(torch.equal(weights0[k], v) for k, v in control.card["transformer"].state_dict().items())
    assert model.card.versions["transformer"] == 30 and control.card.versions["transformer"] == 0


@pytest.mark.parametrize("method", ["finetune", "diffusion_nft", "joint_rl"])
def test_every_method_runs_on_flux(method):
    """One iteration of each remaining method on the FLUX card (the stage/adapter carries everything)."""
    run = RunArgs(frames=1, height=32, width=32)
    sampler = FlowMatchSampler(num_steps=2)
    if method == "finetune":
        module = Finetune(flux_card(), sampler=sampler, run=run)
        data = SyntheticVideos(num_samples=4, batch_size=2, frames=1, height=32, width=32)
    elif method == "diffusion_nft":
        module = DiffusionNFT(flux_card(), sampler=sampler, run=run)
        data = Prompts(prompts=PROMPTS, batch_size=2)
    else:
        module = JointRL(flux_card(num_refiners=1, refiner=Expert(arch="qwen2", trainable=True, optimizer=adamw(1e-3))),
                         sampler=sampler, grpo=GRPOArgs(num_samples_per_prompt=2),
                         refiners=RefinerArgs(max_new_tokens=2), run=run)
        data = Prompts(prompts=PROMPTS, batch_size=2)
    quick_trainer(1).fit(module, data)
    assert module.trainer.global_step == 1


def test_flow_grpo_on_i2v_reads_first_frames_from_the_batch():
    module = FlowGRPO(i2v_card(), sampler=FlowMatchSampler(num_steps=2), grpo=GRPOArgs(num_samples_per_prompt=2),
                      reward=MotionAlignment(), run=RunArgs(frames=5, height=16, width=16))
    quick_trainer(1).fit(module, SyntheticVideos(num_samples=4, batch_size=2, frames=5, height=16, width=16))
    assert module.trainer.global_step == 1
    with pytest.raises(ValueError, match=r"WanI2V \('transformer'\) generates from a first frame, but the batch holds "
                                         r"only \['group', 'index', 'prompt'\]: use a datamodule whose batches carry `image`"):
        quick_trainer(1).fit(module, Prompts(prompts=PROMPTS, batch_size=2))


def test_dmd2_distills_a_wan_i2v_student_from_the_batchs_first_frames():
    """DMD2 on Wan I2V (the image's latents and mask as extra channels, as its pipeline): student and critic start
    as the frozen teacher and both step twice on captioned clips, each row conditioned on its own first frame; a
    batch of prompts alone is refused by name."""
    from posttrain.lit.dmd2 import DMD2
    from tests.helpers import dmd2_steps_student_and_critic_twice

    torch.manual_seed(0)
    card = i2v_card()
    trained = dict(trainable=True, optimizer=adamw(1e-3), init_from="teacher")
    card = ModelCard({**card.specs, "teacher": Expert(arch="wan_i2v"),
                      "transformer": Expert(arch="wan_i2v", **trained), "critic": Expert(arch="wan_i2v", **trained)},
                     text_max_length=32)
    module = DMD2(card, student_steps=2, generator_update_ratio=1,
                  teacher_sampler=FlowMatchSampler(num_steps=4, guidance_scale=4.5),
                  run=RunArgs(frames=5, height=16, width=16))
    dmd2_steps_student_and_critic_twice(module, PROMPTS, SyntheticVideos(num_samples=4, batch_size=2, frames=5,
                                                                         height=16, width=16))
    with pytest.raises(ValueError, match=r"WanI2V \('transformer'\) generates from a first frame, but the batch holds "
                                         r"only \['group', 'index', 'prompt'\]"):
        quick_trainer(1).fit(module, Prompts(prompts=PROMPTS, batch_size=2))


def test_motion_alignment_reads_the_synthetic_motion():
    """On rendered videos: about +1 for the prompt's own direction, -1 for the opposite (a shape cut by the
    frame's edge moves its centroid less)."""
    data = ShapesDataset(12, 5, 32, 32, seed=0)
    videos = torch.stack([data[i]["video"] for i in range(12)])
    prompts = [data[i]["prompt"] for i in range(12)]
    opposite = {"left": "right", "right": "left", "up": "down", "down": "up"}
    flipped = [" ".join(opposite.get(w, w) for w in p.split()) for p in prompts]
    reward = MotionAlignment()
    assert reward(videos, prompts).total.min() > 0.75 and reward(videos, prompts).total.mean() > 0.9
    assert reward(videos, flipped).total.max() < -0.75
    assert reward(videos[:, :, :1], prompts).total.abs().max() == 0  # one frame: no motion to read


def test_bad_generator_input_is_a_clear_error():
    experts = {"text_encoder": Expert(arch="clip"), "vae": Expert(arch="vae_kl"),
               "transformer": Expert(arch="flux", trainable=True, optimizer=adamw())}
    with pytest.raises(ValueError, match=r"the card has no 'text_encoder_2': Flux \('transformer'\) reads it as its "
                                         r"text_encoder_2; add `text_encoder_2: \{arch: t5\}` to card.experts"):
        Finetune(ModelCard(experts))
    swapped = {**experts, "text_encoder": Expert(arch="t5"), "text_encoder_2": Expert(arch="clip")}
    with pytest.raises(ValueError, match=r"reads a CLIP text encoder \(pooled\) then a T5 encoder"):
        Finetune(ModelCard(swapped))
    flux = Finetune(flux_card(), run=RunArgs(frames=5, height=32, width=32))
    with pytest.raises(ValueError, match="frames=5, but FLUX makes images: set frames: 1"):
        flux.configure_model()
    i2v = Finetune(i2v_card(), run=RunArgs(frames=5, height=16, width=16))
    i2v.configure_model()
    with pytest.raises(ValueError, match=r"WanI2V \('transformer'\) generates from a first frame: give it images"):
        i2v.generate(PROMPTS)
    with pytest.raises(ValueError, match=r"conditioning images are 32x32 px but the video is 16x16"):
        i2v.generate(PROMPTS, images=torch.zeros(2, 3, 32, 32))


def test_a_wan_vae_preset_compresses_as_its_layers_do_and_a_config_that_says_otherwise_is_an_error():
    """A preset merges over the world's VAE (4x in space): one with Wan2.1's four levels builds an 8x VAE, and the
    latents it is given are the size its encoder makes (found on a GPU: the 1.3B bench's videos were 4x the tokens
    it said). A config whose ``scale_factor_spatial`` contradicts its layers is refused, naming the value to set."""
    from posttrain.modules.models import presets
    from posttrain.modules.models.vae import latent_shape, scale_factors

    wan21 = dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True])
    vae = presets.build_model("wan_vae", preset=wan21)
    assert scale_factors(vae) == (4, 8)
    assert scale_factors(presets.build_model("wan_vae")) == (4, 4)  # the world's own
    video = torch.zeros(1, 3, 9, 32, 48)
    assert tuple(vae.encode(video).latent_dist.mean.shape[1:]) == latent_shape(vae, 9, 32, 48) == (16, 3, 4, 6)
    wrong = presets.build_model("wan_vae", preset=dict(wan21, scale_factor_spatial=4))
    with pytest.raises(ValueError, match=r"compress 4x in time and 8x in space: set scale_factor_temporal: 4 and "
                                         r"scale_factor_spatial: 8"):
        latent_shape(wrong, 9, 32, 48)


def test_each_vae_is_coded_by_its_familys_codec_found_by_its_class():
    """``modules/models/vae.py`` names no VAE class: every ``vae`` architecture's codec is registered for its class
    (a subclass finds its parent's), the functions there dispatch to it, and a class no family declared is refused
    by name."""
    from diffusers import AutoencoderKLWan

    from posttrain.modules.models import presets
    from posttrain.modules.models.generators.base import codec_of
    from posttrain.modules.models.generators.flux import ImageVAE
    from posttrain.modules.models.generators.wan import WanVAE

    assert set(presets.archs("vae")) >= {"wan_vae", "vae_kl", "wan22_vae"}
    wan, kl = presets.build_model("wan_vae"), presets.build_model("vae_kl")
    assert isinstance(codec_of(wan), WanVAE) and isinstance(codec_of(kl), ImageVAE)
    video = torch.rand(1, 3, 5, 32, 32) * 2 - 1
    for vae in (wan, kl):
        assert torch.equal(codec.encode(vae, video), codec_of(vae).encode(vae, video))
        assert codec.latent_shape(vae, 5, 32, 32) == tuple(codec.encode(vae, video).shape[1:])

    class Longer(AutoencoderKLWan):
        pass

    assert isinstance(codec_of(Longer(**presets.PRESETS["wan_vae"])), WanVAE)
    with pytest.raises(TypeError, match=r"no latent codec for Linear; a VAE family declares one"):
        codec.encode(torch.nn.Linear(2, 2), video)


# torch 2.13's own inductor import (torch/utils/mkldnn.py) calls the deprecated torch.jit.script_method: not ours
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compile_compiles_what_serving_runs():
    """``compile: true`` on an expert: a VAE's encoder and decoder are compiled (diffusers' ``encode``/``decode`` call
    them and never the VAE's forward, so compiling the forward would leave decoding eager), a transformer's forward
    is; weights and state dict keys are unchanged. (Whether it pays: experiments/distill.py --compile-decode.)"""
    plain = ModelCard({"vae": Expert(arch="wan_vae"), "transformer": Expert(arch="wan_t2v")})
    plain.build()
    card = ModelCard({"vae": Expert(arch="wan_vae", compile=True), "transformer": Expert(arch="wan_t2v", compile=True)})
    card.build()
    vae, transformer = card.models["vae"], card.models["transformer"]
    assert vae.decoder._compiled_call_impl is not None and vae.encoder._compiled_call_impl is not None
    assert vae._compiled_call_impl is None  # its forward is not what decode runs
    assert transformer._compiled_call_impl is not None
    for name in ("vae", "transformer"):
        assert list(card.models[name].state_dict()) == list(plain.models[name].state_dict())


def test_channels_last_lays_out_a_vaes_convolutions_and_decodes_the_same():
    """``channels_last: true``: every 3-D convolution of the Wan VAE (and a 2-D one of the KL VAE) is channels-last,
    decoding gives the same pixels up to kernel rounding, the state dict has the same keys and values; an expert with
    no convolution and a sharded one are refused by name. (Whether it pays: bench/decode.py.)"""
    plain = ModelCard({"vae": Expert(arch="wan_vae"), "kl": Expert(arch="vae_kl")})
    plain.build()
    card = ModelCard({"vae": Expert(arch="wan_vae", channels_last=True), "kl": Expert(arch="vae_kl", channels_last=True)})
    card.build()
    convs = [m for m in card.models["vae"].modules() if isinstance(m, torch.nn.Conv3d)]
    assert convs and all(m.weight.is_contiguous(memory_format=torch.channels_last_3d) for m in convs)
    assert not all(m.weight.is_contiguous() for m in convs)
    convs2d = [m for m in card.models["kl"].modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs2d and all(m.weight.is_contiguous(memory_format=torch.channels_last) for m in convs2d)
    for name in ("vae", "kl"):
        ours, theirs = card.models[name].state_dict(), plain.models[name].state_dict()
        assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    latents = torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fast, slow = codec.decode(card.models["vae"], latents), codec.decode(plain.models["vae"], latents)
    assert (fast - slow).abs().max() < 1e-4
    with pytest.raises(ValueError, match="channels_last=true, but .* has no 2-D or 3-D convolution"):
        ModelCard({"text_encoder": Expert(arch="umt5", channels_last=True)}).build()
    with pytest.raises(ValueError, match="channels_last with sharded=true"):
        ModelCard({"transformer": Expert(arch="wan_t2v", channels_last=True, sharded=True, trainable=True,
                                         optimizer=adamw())})
