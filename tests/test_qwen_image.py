"""Qwen-Image, a family added as one file (``modules/models/generators/qwen_image.py``) and its configs: its prompt
embedding is ``QwenImagePipeline.encode_prompt``'s, it finetunes and trains with FlowGRPO (log-probability parity
held), its export run by the real ``QwenImagePipeline`` from the same noise reproduces ``predict`` (float32), and
the published Qwen-Image builds on the meta device at its parameter count."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
from transformers import AutoTokenizer, Qwen2Tokenizer

from posttrain.callbacks.parity import LogProbParityCheck
from posttrain.datamodules.prompts import Prompts
from posttrain.lit.base import RunArgs
from posttrain.lit.diffusion_nft import DiffusionNFT
from posttrain.lit.dmd2 import DMD2
from posttrain.lit.flow_grpo import FlowGRPO
from posttrain.lit.joint_rl import JointRL
from posttrain.lit.tools.export import export
from posttrain.modules.flow.samplers import FlowMatchSampler
from posttrain.modules.models import presets
from posttrain.modules.models.cards import Expert, ModelCard
from posttrain.modules.models.generators import ADAPTERS, GeneratorStage, VideoSize
from posttrain.modules.models.generators.base import codec_of
from posttrain.modules.models.generators.qwen_image import (DROP_TOKENS, MAX_PROMPT_TOKENS, PROMPT_TEMPLATE,
                                                            TOKENIZER_ASSET, QwenImageVAE)
from posttrain.modules.rewards.synthetic import ColourAlignment
from posttrain.modules.rl.grpo import GRPOArgs
from posttrain.modules.rl.refiner_args import RefinerArgs
from tests.conftest import adamw
from tests.helpers import (dmd2_steps_student_and_critic_twice, fit_shipped_config_once,
                           joint_rl_steps_refiner_and_generator, quick_trainer)
from tests.test_estimate import shipped_config_estimate_matches_a_real_forward
from tests.test_export_generators import finetuned

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["a red circle moving left on a blue background", "a yellow square"]  # of different lengths: a mask


def qwen_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Qwen-Image's scheduler_config.json (as configs/finetune_qwen_image.yaml gives it)."""
    return FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                           base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                                           time_shift_type="exponential")


def qwen_card(lr: float = 1e-2, text_max_length: int = 64) -> ModelCard:
    """A tiny Qwen2.5-VL (frozen) with the template tokenizer, the world's VAE, a trainable tiny Qwen-Image: the
    text encoder and transformer random (the full preset as overrides), as the parity figures of the guide were
    measured; the shipped pretrained pair is checked in ``test_the_shipped_tiny_qwen_image_follows_the_prompt``."""
    return ModelCard({"text_encoder": Expert(arch="qwen2_5_vl", tokenizer=TOKENIZER_ASSET,
                                             preset=dict(presets.PRESETS["qwen2_5_vl"])),
                      "vae": Expert(arch="qwen_image_vae"),
                      "transformer": Expert(arch="qwen_image", trainable=True, optimizer=adamw(lr),
                                            preset=dict(presets.PRESETS["qwen_image"]))},
                     text_max_length=text_max_length)


def pipeline_of(card: ModelCard) -> QwenImagePipeline:
    return QwenImagePipeline(scheduler=qwen_scheduler(), vae=card["vae"], text_encoder=card["text_encoder"],
                             tokenizer=card.tokenizers["text_encoder"], transformer=card["transformer"])


def test_the_template_tokenizer_drops_exactly_the_system_turn():
    """The shipped tokenizer (scripts/make_qwen_tokenizer.py) is a Qwen2Tokenizer whose first DROP_TOKENS tokens of
    the template are Qwen2.5's: the system turn and ``<|im_start|>user\\n``; the prompt starts right after them.
    Its ids fit the tiny text encoder's vocabulary (ByT5's 384 too)."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_ASSET)
    assert isinstance(tokenizer, Qwen2Tokenizer) and len(tokenizer) == 367
    assert len(tokenizer) <= presets.PRESETS["qwen2_5_vl"]["text_config"]["vocab_size"]
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(PROMPT_TEMPLATE.format("red")).input_ids)
    words = ("Describe the image by detailing the color , shape , size , texture , quantity , text , spatial "
             "relationships of the objects and background :").split()
    system = ["<|im_start|>", "system", "Ċ"] + [w if i == 0 or w in ",:" else "Ġ" + w for i, w in enumerate(words)]
    assert tokens[:DROP_TOKENS] == system + ["<|im_end|>", "Ċ", "<|im_start|>", "user", "Ċ"]
    assert tokens[DROP_TOKENS:] == ["r", "e", "d", "<|im_end|>", "Ċ", "<|im_start|>", "assistant", "Ċ"]
    pipe = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    assert (pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx, pipe.tokenizer_max_length) == \
        (PROMPT_TEMPLATE, DROP_TOKENS, MAX_PROMPT_TOKENS)


def test_prompt_embedding_is_the_pipelines_encode_prompt(one_thread):
    """The conditioning equals ``QwenImagePipeline.encode_prompt`` on the same prompts (exactly), zero-padded to
    text_max_length: the states of each prompt's tokens past the template's first 34, the mask of the shorter one.
    A row from the cache reads the same, and velocity runs the pipeline's (unpadded) text."""
    card = qwen_card()
    card.build()
    stage = GeneratorStage.named(card)
    cond = stage.condition(PROMPTS)
    states, mask = pipeline_of(card).encode_prompt(PROMPTS, device="cpu", max_sequence_length=card.text_max_length)
    length = states.shape[1]
    # "a yellow square": 14 tokens, then the template's 5 after the prompt
    assert mask is not None and mask.sum(1).tolist() == [length, 19] and length < card.text_max_length
    assert torch.equal(cond["encoder_hidden_states"][:, :length], states)
    assert torch.equal(cond["encoder_hidden_states_mask"][:, :length], mask)
    assert not cond["encoder_hidden_states"][:, length:].any()
    assert not cond["encoder_hidden_states_mask"][:, length:].any()
    assert card.cache.misses == 2
    again = stage.condition(PROMPTS[::-1])  # from the cache: the same rows and masks, in the new order
    assert card.cache.hits == 2
    assert all(torch.equal(again[k], cond[k].flip(0)) for k in cond)
    # one prompt alone: encode_prompt gives no mask (nothing padded); the velocity equals the transformer's on it
    x = torch.randn(1, *stage.latent_shape(VideoSize(1, 32, 32)))
    alone, none = pipeline_of(card).encode_prompt(PROMPTS[1:], device="cpu", max_sequence_length=card.text_max_length)
    assert none is None
    with stage.velocity() as velocity, torch.no_grad():
        ours = velocity(x, torch.tensor([700.0]), cond.select([1]))
        theirs = card["transformer"](hidden_states=QwenImagePipeline._pack_latents(x[:, :, 0], 1, 16, 8, 8),
                                     timestep=torch.tensor([0.7]), encoder_hidden_states=alone,
                                     img_shapes=[[(1, 4, 4)]], return_dict=False)[0]
    assert (ours - QwenImagePipeline._unpack_latents(theirs, 8, 8, 1)).abs().max() < 1e-6


def test_the_vae_codec_and_the_size_checks(one_thread):
    """AutoencoderKLQwenImage through the codec: Wan's normalization reused (pixels -> (B, 16, 1, H/4, W/4) ->
    pixels); the spatial factor the pipeline reads (2^len(temperal_downsample)); an image size off the 2×2 packing,
    a video, a VAE whose levels and temperal_downsample disagree, and a text longer than the pipeline's are refused."""
    card = qwen_card()
    card.build()
    stage = GeneratorStage.named(card)
    vae = card["vae"]
    assert isinstance(codec_of(vae), QwenImageVAE) and codec_of(vae).scale_factors(vae) == (4, 4)
    assert pipeline_of(card).vae_scale_factor == 4
    image = torch.rand(2, 3, 1, 32, 32) * 2 - 1
    latents = stage.encode(image)
    assert latents.shape == (2, 16, 1, 8, 8) and stage.decode(latents).shape == (2, 3, 1, 32, 32)
    with pytest.raises(ValueError, match=r"height=36 must be a multiple of 8 \(VAE factor 4 × patch 2\); e.g. 40"):
        stage.latent_shape(VideoSize(1, 36, 32))
    with pytest.raises(ValueError, match="frames=5, but Qwen-Image makes images: set frames: 1"):
        stage.latent_shape(VideoSize(5, 32, 32))
    bad = presets.build_model("qwen_image_vae", preset={"temperal_downsample": [False, True, True]})
    with pytest.raises(ValueError, match=r"dim_mult \[1, 1, 1\] \(2 downsampling levels\) but temperal_downsample "
                                         r"\[False, True, True\]"):
        QwenImageVAE().scale_factors(bad)
    long = qwen_card(text_max_length=MAX_PROMPT_TOKENS + 1)
    long.build()
    assert any("text_max_length=1025, but QwenImagePipeline embeds at most 1024" in p
               for p in GeneratorStage.named(long).problems())


@pytest.mark.parametrize("guidance", [1.0, 3.0], ids=["no_cfg", "cfg3"])
def test_export_reproduces_predict(tmp_path, guidance, one_thread):
    """QwenImagePipeline on the exported folder (EMA transformer, the run's scheduler), given the packed noise: max
    |Δ latents| < 1e-5 and the same pixels. CFG is the pipeline's true CFG (``true_cfg_scale`` with the empty
    negative prompt): each token's guided velocity rescaled to the conditional one's norm."""
    module, ckpt = finetuned(tmp_path, qwen_card(), RunArgs(frames=1, height=32, width=32), guidance, qwen_scheduler())
    out = export(ckpt, str(tmp_path / "pipe"))
    assert sorted(os.listdir(out)) == ["model_index.json", "scheduler", "serving.json", "text_encoder", "tokenizer",
                                       "transformer", "vae"]
    pipe = QwenImagePipeline.from_pretrained(out)
    assert isinstance(pipe.tokenizer, Qwen2Tokenizer) and pipe.scheduler.config.time_shift_type == "exponential"
    call = json.load(open(os.path.join(out, "serving.json")))
    assert call.pop("pipeline") == "QwenImagePipeline" and call.pop("transformer") == "transformer_ema"
    assert call["true_cfg_scale"] == guidance and call["max_sequence_length"] == 64
    assert call.get("negative_prompt") == ("" if guidance != 1.0 else None)

    ours = module.generate(PROMPTS, seed=7, latents_only=True)  # (B, 16, 1, 8, 8)
    noise = torch.randn((len(PROMPTS), *module.stage.latent_shape(module.video)),
                        generator=torch.Generator().manual_seed(7))
    packed = QwenImagePipeline._pack_latents(noise[:, :, 0], len(PROMPTS), 16, 8, 8)
    theirs = pipe(PROMPTS, latents=packed, output_type="latent", **call).images  # (B, 16 tokens, 64)
    gap = (ours - QwenImagePipeline._unpack_latents(theirs, 8, 8, 1)).abs().max().item()
    print(f"QwenImagePipeline vs predict (true_cfg_scale {guidance}): max |Δ latents| = {gap:.2e}")
    assert gap < 1e-5
    images = pipe(PROMPTS, latents=packed, output_type="pt", **call).images  # (B, 3, H, W) in [0, 1]
    assert ((module.stage.decode(ours)[:, :, 0] + 1) / 2 - images).abs().max() < 1e-5
    ema = module.card["transformer_ema"].state_dict()
    assert all(torch.equal(pipe.transformer.state_dict()[k], ema[k]) for k in ema)


def test_guidance_is_the_pipelines_true_cfg():
    """``QwenImage.guided`` by hand: per packed token (4 channels x a 2x2 patch: 16 values), the plain CFG velocity
    rescaled to the conditional one's norm; rows at scale 1 are the conditional velocity itself. v_c = 1 everywhere
    (norm 4 a token), v_u = 0: plain CFG at 3 is 3 (norm 12), rescaled to 1. Where v_u = 3: 3 + 3·(1 - 3) = -3,
    rescaled to -1."""
    guided = ADAPTERS["qwen_image"].guided
    v_cond, v_uncond = torch.ones(2, 4, 1, 4, 4), torch.zeros(2, 4, 1, 4, 4)
    assert torch.allclose(guided(v_cond, v_uncond, 3.0), v_cond)
    v_uncond[:, :, :, :2, :2] = 3.0  # the first token of each row
    out = guided(v_cond, v_uncond, torch.tensor([3.0, 1.0]))
    assert torch.allclose(out[0, :, :, :2, :2], -torch.ones(4, 1, 2, 2))
    assert torch.allclose(out[0, :, :, 2:], torch.ones(4, 1, 2, 4)) and torch.equal(out[1], v_cond[1])


def test_flow_grpo_keeps_log_probability_parity(one_thread):
    """Three FlowGRPO iterations (K = 2 SDE rollouts of 4 steps under true CFG 2, the masked text of two prompt
    lengths): the rollout's log p recomputed at its weights equals the captured one (float32) at every iteration,
    and the policy moves."""
    card = qwen_card(lr=1e-3)
    model = FlowGRPO(card, reward=ColourAlignment(), sampler=FlowMatchSampler(num_steps=4, noise_level=0.7,
                                                                              guidance_scale=2.0,
                                                                              scheduler=qwen_scheduler()),
                     grpo=GRPOArgs(num_samples_per_prompt=2, timestep_fraction=1.0), run=RunArgs(frames=1, height=32,
                                                                                                 width=32))
    model.configure_model()
    before = {k: v.clone() for k, v in card["transformer"].state_dict().items()}
    parity = LogProbParityCheck(every_n_iterations=1, tolerance=1e-5)
    quick_trainer(3, callbacks=[parity]).fit(model, Prompts(prompts=PROMPTS, batch_size=2))
    print(f"FlowGRPO Qwen-Image: largest log-probability gap {parity.last_gap:.2e}")
    assert parity.checks == 3 and parity.last_gap < 1e-5
    assert card.versions["transformer"] == 3
    assert any(not torch.equal(before[k], v) for k, v in card["transformer"].state_dict().items())


def test_diffusion_nft_trains(one_thread):
    """DiffusionNFT (K = 2 rollouts a prompt, the masked text of two prompt lengths): two iterations move the
    transformer, each a version, with its ``old`` copy blended behind it."""
    card = qwen_card(lr=1e-3)
    model = DiffusionNFT(card, reward=ColourAlignment(),
                         sampler=FlowMatchSampler(num_steps=4, scheduler=qwen_scheduler()),
                         grpo=GRPOArgs(num_samples_per_prompt=2), run=RunArgs(frames=1, height=32, width=32))
    model.configure_model()
    before = {k: v.clone() for k, v in card["transformer"].state_dict().items()}
    quick_trainer(2).fit(model, Prompts(prompts=PROMPTS, batch_size=2))
    after = card["transformer"].state_dict()
    assert card.versions["transformer"] == 2
    assert any(not torch.equal(before[k], v) for k, v in after.items())
    old = card.models[model.old].state_dict()
    assert any(not torch.equal(old[k], after[k]) for k in after)


def distill_card(lr: float = 1e-3) -> ModelCard:
    """DMD2's experts on Qwen-Image: the tiny text encoder, VAE and teacher frozen; the student (``transformer``) and
    the critic trainable, both started from the teacher (``init_from``)."""
    def trained() -> Expert:
        return Expert(arch="qwen_image", trainable=True, optimizer=adamw(lr), init_from="teacher")

    return ModelCard({"text_encoder": Expert(arch="qwen2_5_vl", tokenizer=TOKENIZER_ASSET),
                      "vae": Expert(arch="qwen_image_vae"), "teacher": Expert(arch="qwen_image"),
                      "transformer": trained(), "critic": trained()}, text_max_length=64)


def weights_of(card: ModelCard, name: str) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in card[name].state_dict().items()}


def test_dmd2_distills_a_two_step_student(one_thread):
    """DMD2 on Qwen-Image (a 2-step student; the real score the teacher's true CFG 4.5 on the masked text of two
    prompt lengths; the student steps every iteration): two iterations step student and critic twice each and move
    both, the teacher stays bit for bit at version 0, and both losses are finite."""
    torch.manual_seed(0)  # the same weights in every run wherever a preset is random
    card = distill_card()
    module = DMD2(card, student_steps=2, generator_update_ratio=1,
                  teacher_sampler=FlowMatchSampler(num_steps=4, guidance_scale=4.5, scheduler=qwen_scheduler()),
                  run=RunArgs(frames=1, height=32, width=32))
    dmd2_steps_student_and_critic_twice(module, PROMPTS)


def test_joint_rl_trains_a_refiner_and_the_generator(one_thread):
    """Joint RL with a Qwen-Image generator: one tiny Qwen2 refiner appends to each request, its text is served through
    Qwen-Image's chat template to the generator, one reward (ColourAlignment) scores the K = 4 images of each request.
    The rollout's log-probabilities (the generator's SDE steps, the refiner's tokens) recompute at its weights; one
    iteration steps both experts once (each a version, the refiner's and the generator's own), moves both, and leaves
    their frozen KL references at version 0."""
    torch.manual_seed(0)
    card = ModelCard({"text_encoder": Expert(arch="qwen2_5_vl", tokenizer=TOKENIZER_ASSET),
                      "vae": Expert(arch="qwen_image_vae"),
                      "transformer": Expert(arch="qwen_image", trainable=True, optimizer=adamw(1e-3))},
                     num_refiners=1, refiner=Expert(arch="qwen2", trainable=True, optimizer=adamw(2e-2)),
                     text_max_length=96)
    module = JointRL(card, FlowMatchSampler(num_steps=3, scheduler=qwen_scheduler()), reward=ColourAlignment(),
                     grpo=GRPOArgs(num_samples_per_prompt=4, timestep_fraction=1.0),
                     refiners=RefinerArgs(max_new_tokens=8, mode="append", num_unrefined=1),
                     run=RunArgs(frames=1, height=32, width=32))
    joint_rl_steps_refiner_and_generator(module, PROMPTS)


@pytest.mark.parametrize("config", ["finetune_qwen_image.yaml", "flow_grpo_qwen_image.yaml"])
def test_qwen_image_configs_train_one_iteration(config, tmp_path, monkeypatch):
    """The shipped configs through the command (in this process, from the repository root, where their tokenizer
    folder is): one finetune / FlowGRPO iteration (the FlowGRPO one under its LogProbParityCheck), a checkpoint."""
    monkeypatch.chdir(ROOT)
    fit_shipped_config_once(config, tmp_path / "run")


def test_activation_estimate_matches_a_real_forward(tmp_path):
    """``posttrain estimate`` on configs/finetune_qwen_image.yaml (3 blocks, 2 rows of 32x32 images, the full
    64-token text with its mask) against the bytes a real forward saves for backward."""
    shipped_config_estimate_matches_a_real_forward(tmp_path, "finetune_qwen_image.yaml", "qwen_image",
                                                   {"num_layers": 3}, text_encoder={"tokenizer": TOKENIZER_ASSET})


def test_the_shipped_tiny_qwen_image_follows_the_prompt(one_thread):
    """The presets without overrides are the pretrained tiny Qwen-Image (scripts/train_qwen_image.py: transformer and
    Qwen2.5-VL trained together on the world's first frames) over the world's Wan VAE, loaded key for key. Sampled
    through the evaluation path (20 steps, Qwen-Image's scheduler, no CFG) on 32 prompts of concepts it saw, drawn
    from a seed its training never used, colour and background read back far above chance (1/6) and above what the
    same images score against the batch's other prompts (a generator that drew the same thing whatever the prompt
    would score alike on both). Its shapes are blobs: shape reads back at chance (1/3), printed, not asserted."""
    from posttrain.datamodules.synthetic import PRETRAIN_EXCLUDE, ShapesDataset
    from posttrain.modules.eval.evaluation import generate
    from posttrain.modules.world.geneval import judge

    vae, world_vae = presets.build_model("qwen_image_vae").eval(), presets.build_model("wan_vae")
    assert type(vae).__name__ == "AutoencoderKLQwenImage" and vae.state_dict().keys() == world_vae.state_dict().keys()
    assert all(torch.equal(v, world_vae.state_dict()[k]) for k, v in vae.state_dict().items())
    data = ShapesDataset(32, 1, 8, 8, seed=31, exclude=PRETRAIN_EXCLUDE)
    prompts = [data[i]["prompt"] for i in range(32)]
    images = generate(presets.build_model("qwen_image").eval(), presets.build_model("qwen2_5_vl").eval(),
                      AutoTokenizer.from_pretrained(TOKENIZER_ASSET), vae, prompts, seed=31, frames=1, height=32,
                      width=32, sampler=FlowMatchSampler(num_steps=20, scheduler=qwen_scheduler()), arch="qwen_image")
    facts = ("shape", "colour", "background")
    matched = {k: float(v.nanmean()) for k, v in judge(images, prompts).items() if k in facts}
    others = {k: float(v.nanmean()) for k, v in judge(images, prompts[1:] + prompts[:1]).items() if k in facts}
    print(f"shipped tiny Qwen-Image: {matched}; against other prompts {others}")
    assert matched["colour"] >= 0.8 and matched["background"] >= 0.9, matched
    assert matched["colour"] > others["colour"] + 0.3 and matched["background"] > others["background"] + 0.3, others


def test_a_text_encoder_saved_in_the_older_layout_streams_into_fp8(tmp_path, one_thread):
    """The hub's Qwen-Image ``text_encoder`` holds Qwen2.5-VL under the names before transformers 5
    (``model.layers.*``; transformers 5 builds ``model.language_model.layers.*``), as ``save_pretrained`` still
    writes them: ``fp8: true`` streams such a folder tensor by tensor through transformers' own renamings, and gives
    the text rows of the same weights loaded by ``from_pretrained`` (float8 block weights: within 3%)."""
    from safetensors import safe_open

    from optimum.quanto import QLinear

    torch.manual_seed(0)
    preset = copy.deepcopy(presets.architecture("qwen2_5_vl").preset)  # random weights of the tiny preset
    presets.build_model("qwen2_5_vl", preset=preset).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        assert "model.layers.0.mlp.down_proj.weight" in handle.keys()  # the older names on disk
    plain = presets.build_model("qwen2_5_vl", pretrained=str(tmp_path))
    streamed = presets.build_model("qwen2_5_vl", pretrained=str(tmp_path), fp8=True)
    layers = streamed.model.language_model.layers
    assert all(isinstance(layer.mlp.down_proj, QLinear) and isinstance(layer.self_attn.q_proj, QLinear)
               for layer in layers)  # its block Linears in float8
    ids = torch.randint(0, 300, (2, 12))
    with torch.no_grad():
        expected = plain.model.language_model(input_ids=ids).last_hidden_state
        rows = streamed.model.language_model(input_ids=ids).last_hidden_state
    assert (rows - expected).norm() / expected.norm() < 0.03
