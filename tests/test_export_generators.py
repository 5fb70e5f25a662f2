"""FLUX and Wan I2V export as folders their diffusers pipelines load, complete with scheduler, tokenizers and
text encoders; run by the real ``FluxPipeline`` / ``WanImageToVideoPipeline`` from the same noise (and image)
the exported folder reproduces the package's own samples (float32)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, WanImageToVideoPipeline

from posttrain.datamodules.synthetic import SyntheticVideos
from posttrain.lit.base import RunArgs
from posttrain.lit.tools.export import export
from posttrain.lit.finetune import Finetune
from posttrain.modules.models.generators import Flux
from posttrain.modules.flow.samplers import FlowMatchSampler
from tests.conftest import flux_card, i2v_card
from tests.helpers import quick_trainer

PROMPTS = ["a red circle moving left on a blue background", "a yellow square moving down on a green background"]


def flux_scheduler():
    """FLUX.1's scheduler config: resolution-dependent shift (mu) instead of a fixed one."""
    return FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                           base_image_seq_len=256, max_image_seq_len=4096)


def finetuned(tmp_path, card, size: RunArgs, guidance: float, scheduler=None):
    """Two finetune iterations (lr 1e-2, EMA 0.9, 4 sampler steps) and the checkpoint."""
    module = Finetune(card, sampler=FlowMatchSampler(num_steps=4, guidance_scale=guidance, scheduler=scheduler),
                      caption_dropout=0.0, ema_decay=0.9, run=size)
    trainer = quick_trainer(max_steps=2, default_root_dir=tmp_path)
    trainer.fit(module, SyntheticVideos(num_samples=8, batch_size=2, frames=size.frames, height=size.height,
                                        width=size.width))
    ckpt = tmp_path / "run.ckpt"
    trainer.save_checkpoint(ckpt)
    return module.eval(), str(ckpt)


@pytest.mark.parametrize("guidance,distilled", [(1.0, False), (3.0, False), (1.0, True)],
                         ids=["no_cfg", "cfg3", "guidance_embeds"])
def test_flux_export_reproduces_predict(tmp_path, guidance, distilled, one_thread):
    """FluxPipeline on the exported folder, given ``Flux.pack(noise)``: max |Δ latents| < 1e-4 and the same
    pixels; CFG runs as FluxPipeline's true CFG with the empty negative prompt; a guidance-distilled
    transformer reads the embedded guidance (``run.embedded_guidance`` = the pipeline's ``guidance_scale``)."""
    size = RunArgs(frames=1, height=32, width=32, embedded_guidance=2.5)
    card = flux_card(lr=1e-2, transformer_preset={"guidance_embeds": True} if distilled else None)
    module, ckpt = finetuned(tmp_path, card, size, guidance, flux_scheduler())
    out = export(ckpt, str(tmp_path / "pipe"))
    assert sorted(os.listdir(out)) == ["model_index.json", "scheduler", "serving.json", "text_encoder",
                                       "text_encoder_2", "tokenizer", "tokenizer_2", "transformer", "vae"]
    pipe = FluxPipeline.from_pretrained(out)
    call = json.load(open(os.path.join(out, "serving.json")))
    assert call.pop("pipeline") == "FluxPipeline" and call.pop("transformer") == "transformer_ema"
    assert call["guidance_scale"] == 2.5 and call.get("true_cfg_scale", 1.0) == guidance
    assert pipe.tokenizer.model_max_length == card["text_encoder"].config.max_position_embeddings

    ours = module.generate(PROMPTS, seed=7, latents_only=True)  # (B, 16, 1, 8, 8)
    noise = torch.randn((len(PROMPTS), *module.stage.latent_shape(module.video)),
                        generator=torch.Generator().manual_seed(7))
    packed = pipe(PROMPTS, latents=Flux.pack(noise), output_type="latent", **call).images  # (B, 16, 64)
    theirs = Flux.unpack(packed, *ours.shape[-2:])
    gap = (ours - theirs).abs().max().item()
    print(f"FluxPipeline vs predict ({'distilled' if distilled else f'cfg {guidance}'}): max |Δ latents| = {gap:.2e}")
    assert gap < 1e-4
    images = pipe(PROMPTS, latents=Flux.pack(noise), output_type="pt", **call).images  # (B, 3, H, W) in [0, 1]
    pixels = (module.stage.decode(ours)[:, :, 0] + 1) / 2
    assert (pixels - images).abs().max() < 1e-4
    ema = module.card["transformer_ema"].state_dict()
    assert all(torch.equal(pipe.transformer.state_dict()[k], ema[k]) for k in ema)


@pytest.mark.parametrize("guidance", [1.0, 3.0], ids=["no_cfg", "cfg3"])
def test_i2v_export_reproduces_predict(tmp_path, guidance, one_thread):
    """WanImageToVideoPipeline on the exported folder, given the same noise and first frame (as a [0, 1]
    tensor, which its video processor maps to [-1, 1]): max |Δ latents| < 1e-4. The pipeline takes one
    image per call, so each sample runs on its own."""
    size = RunArgs(frames=5, height=16, width=16)
    module, ckpt = finetuned(tmp_path, i2v_card(lr=1e-2), size, guidance)
    out = export(ckpt, str(tmp_path / "pipe"))
    pipe = WanImageToVideoPipeline.from_pretrained(out)
    assert pipe.image_encoder is None and pipe.transformer.config.in_channels == 36
    call = json.load(open(os.path.join(out, "serving.json")))
    assert call.pop("pipeline") == "WanImageToVideoPipeline"
    call.pop("transformer")

    images = torch.stack([SyntheticVideos(frames=5, height=16, width=16).train_dataset()[i]["video"][:, 0]
                          for i in range(2)])  # (2, 3, 16, 16) in [-1, 1]
    ours = module.generate(PROMPTS, seed=3, latents_only=True, images=images)
    noise = torch.randn((len(PROMPTS), *module.stage.latent_shape(module.video)),
                        generator=torch.Generator().manual_seed(3))
    gaps = []
    for b in range(len(PROMPTS)):
        theirs = pipe(prompt=PROMPTS[b], image=(images[b:b + 1] + 1) / 2, latents=noise[b:b + 1], output_type="latent",
                      **call).frames
        gaps.append((ours[b:b + 1] - theirs).abs().max().item())
    print(f"WanImageToVideoPipeline vs predict, guidance {guidance}: max |Δ latents| = {max(gaps):.2e}")
    assert max(gaps) < 1e-4


def test_wan21_i2v_with_an_image_encoder(tmp_path, one_thread):
    """A Wan 2.1-style I2V (``image_dim``, ``added_kv_proj_dim``; 512 text tokens) reads the card's CLIP vision
    ``image_encoder`` too; the exported folder carries it and its processor, and WanImageToVideoPipeline given
    the same (8-bit) image and noise reproduces the package's samples."""
    from PIL import Image

    from posttrain.modules.models.cards import Expert
    from tests.conftest import adamw
    from posttrain.modules.models.cards import ModelCard

    heads, dim = 2, 32
    card = ModelCard({"text_encoder": Expert(arch="umt5"), "vae": Expert(arch="wan_vae"),
                      "image_encoder": Expert(arch="clip_vision", preset={"image_size": 16, "patch_size": 8}),
                      "transformer": Expert(arch="wan_i2v", trainable=True, optimizer=adamw(1e-2), preset=dict(
                          num_attention_heads=heads, attention_head_dim=dim, ffn_dim=128, num_layers=2,
                          image_dim=32, added_kv_proj_dim=heads * dim))}, text_max_length=512)
    size = RunArgs(frames=5, height=16, width=16)
    module, ckpt = finetuned(tmp_path, card, size, guidance=1.0)
    assert module.stage.image_encoder == "image_encoder"
    out = export(ckpt, str(tmp_path / "pipe"))
    assert {"image_encoder", "image_processor"} <= set(os.listdir(out))
    pipe = WanImageToVideoPipeline.from_pretrained(out)
    call = {k: v for k, v in json.load(open(os.path.join(out, "serving.json"))).items()
            if k not in ("pipeline", "transformer")}
    data = SyntheticVideos(frames=5, height=16, width=16).train_dataset()
    eight_bit = [((data[i]["video"][:, 0] + 1) * 127.5).round().to(torch.uint8) for i in range(2)]
    images = torch.stack([e.float() / 127.5 - 1 for e in eight_bit])  # the 8-bit images, in [-1, 1]
    ours = module.generate(PROMPTS, seed=5, latents_only=True, images=images)
    assert set(module.stage.condition(PROMPTS, images=images, size=module.video)) == \
        {"encoder_hidden_states", "image_latents", "encoder_hidden_states_image"}
    noise = torch.randn((2, *module.stage.latent_shape(module.video)), generator=torch.Generator().manual_seed(5))
    gaps = []
    for b in range(2):
        pil = Image.fromarray(eight_bit[b].permute(1, 2, 0).numpy())
        theirs = pipe(prompt=PROMPTS[b], image=pil, latents=noise[b:b + 1], output_type="latent", **call).frames
        gaps.append((ours[b:b + 1] - theirs).abs().max().item())
    print(f"WanImageToVideoPipeline (Wan 2.1, image encoder) vs predict: max |Δ latents| = {max(gaps):.2e}")
    assert max(gaps) < 1e-4
