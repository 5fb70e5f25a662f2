"""Stable Diffusion 3, a family added as one file (``modules/models/generators/sd3.py``) and its configs: it builds from
its preset, samples through the one sampler, finetunes and trains with FlowGRPO from its configs (no method code of
its own), ``posttrain estimate`` traces it, and its export run by the real ``StableDiffusion3Pipeline`` from the same
noise reproduces ``predict`` (float32)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from posttrain.lit.base import RunArgs
from posttrain.lit.tools.export import export
from posttrain.modules.models.cards import Expert, ModelCard
from tests.conftest import adamw
from tests.helpers import fit_shipped_config_once
from tests.test_estimate import shipped_config_estimate_matches_a_real_forward
from tests.test_export_generators import finetuned

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["a red circle moving left on a blue background", "a yellow square moving down on a green background"]


def sd3_card(lr: float) -> ModelCard:
    """Two CLIPs with projection and the world's T5 (frozen), the world's image VAE, a trainable tiny SD3."""
    return ModelCard({"text_encoder": Expert(arch="clip_projection"), "text_encoder_2": Expert(arch="clip_projection"),
                      "text_encoder_3": Expert(arch="t5"), "vae": Expert(arch="vae_kl"),
                      "transformer": Expert(arch="sd3", trainable=True, optimizer=adamw(lr))}, text_max_length=32)


def test_sd3_export_reproduces_predict(tmp_path, one_thread):
    """StableDiffusion3Pipeline on the exported folder (EMA transformer, CFG 3 with the empty negative prompt, the
    run's scheduler), given the same noise: max |Δ latents| < 1e-4 and the same pixels."""
    module, ckpt = finetuned(tmp_path, sd3_card(lr=1e-2), RunArgs(frames=1, height=32, width=32), guidance=3.0)
    out = export(ckpt, str(tmp_path / "pipe"))
    assert sorted(os.listdir(out)) == ["model_index.json", "scheduler", "serving.json", "text_encoder",
                                       "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3",
                                       "transformer", "vae"]
    pipe = StableDiffusion3Pipeline.from_pretrained(out)
    call = json.load(open(os.path.join(out, "serving.json")))
    assert call.pop("pipeline") == "StableDiffusion3Pipeline" and call.pop("transformer") == "transformer_ema"

    ours = module.generate(PROMPTS, seed=7, latents_only=True)  # (B, 16, 1, 8, 8)
    noise = torch.randn((len(PROMPTS), *module.stage.latent_shape(module.video)),
                        generator=torch.Generator().manual_seed(7))
    theirs = pipe(PROMPTS, latents=noise[:, :, 0], output_type="latent", **call).images  # (B, 16, 8, 8)
    gap = (ours[:, :, 0] - theirs).abs().max().item()
    print(f"StableDiffusion3Pipeline vs predict (cfg 3): max |Δ latents| = {gap:.2e}")
    assert gap < 1e-4
    images = pipe(PROMPTS, latents=noise[:, :, 0], output_type="pt", **call).images  # (B, 3, H, W) in [0, 1]
    assert ((module.stage.decode(ours)[:, :, 0] + 1) / 2 - images).abs().max() < 1e-4
    ema = module.card["transformer_ema"].state_dict()
    assert all(torch.equal(pipe.transformer.state_dict()[k], ema[k]) for k in ema)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["finetune_sd3.yaml", "flow_grpo_sd3.yaml"])
def test_sd3_configs_train_one_iteration(config, tmp_path):
    """The shipped configs through the command (in this process): one finetune / FlowGRPO iteration, a checkpoint."""
    fit_shipped_config_once(config, tmp_path / "run")


@pytest.mark.slow
def test_sd3_activation_estimate_matches_a_real_forward(tmp_path):
    """``posttrain estimate`` on configs/finetune_sd3.yaml (3 blocks, 2 rows of 32x32 images) against the bytes a
    real forward saves for backward."""
    shipped_config_estimate_matches_a_real_forward(tmp_path, "finetune_sd3.yaml", "sd3", {"num_layers": 3})
