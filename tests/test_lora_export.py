"""A LoRA run's adapter alone, in the formats users load: every checkpoint holds it (``adapter/``), ``posttrain export``
writes it without the base, and both formats — diffusers' PEFT keys and the original checkpoint's key names that
ComfyUI reads — load with diffusers' own ``load_lora_weights`` (which converts the original names itself) and
reproduce the package's samples.

The original names are checked against the published module names of Wan 2.1 (``WanModel``: blocks.N.self_attn.q …)
and FLUX.1 (``Flux``: double_blocks.N.img_attn.qkv …), and against diffusers' converter, which must give back the
adapter exactly: its update ΔW = scale · B A, per layer, to float32 rounding (0 measured).

Storage is bfloat16, so each sample is compared with the package's own sample from the same adapter rounded to
bfloat16: max |Δ latents| < 1e-4 (the float32 export's bound); the gap to the unrounded adapter is printed.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

import launch
from posttrain.callbacks.checkpoints import ModelCheckpoint
from posttrain.datamodules.synthetic import SyntheticVideos
from posttrain.lit.base import RunArgs
from posttrain.lit.finetune import Finetune
from posttrain.lit.tools.export import export
from posttrain.modules.flow.samplers import FlowMatchSampler
from posttrain.modules.io import checkpoints as ckpt
from posttrain.modules.io import lora
from posttrain.modules.models import presets
from posttrain.modules.models.cards import LoraConfig
from posttrain.modules.models.generators.flux import FLUX_LORA_NAMES
from posttrain.modules.models.generators.wan import WAN_LORA_NAMES
from tests.conftest import TINY_WAN, flux_card, wan_card
from tests.helpers import quick_trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["a red circle moving left on a blue background", "a yellow square moving down on a magenta background"]
FILES = sorted([lora.INFO, *lora.FILES.values()])
# rank 4, alpha 8: scale 2, a power of two, so folding it into lora_B (layers outside Wan's blocks) stays exact in bf16;
# the blocks' attention and FFN, the output head and the time projection (both folded) are trained
WAN_LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj",
                                                         "ffn.net.2", "proj_out", "time_proj"])


def deltas(layers: dict[str, torch.Tensor], scale: float = 1.0) -> dict[str, torch.Tensor]:
    """module -> its update ΔW = scale · B A (PEFT keys, with or without the ``transformer.`` prefix; linear layers)."""
    return {key.removeprefix("transformer.")[:-len(".lora_A.weight")]:
            scale * layers[key.replace(".lora_A.", ".lora_B.")].float() @ layers[key].float()
            for key in layers if key.endswith(".lora_A.weight") and layers[key].dim() == 2}


def random_adapter(model: torch.nn.Module) -> None:
    """Every LoRA weight random (B starts at zero, which would hide a wrong scale or a swapped part)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator))


# ---------------------------------------------------------------------- the original names
def test_wan_original_names_are_the_published_ones(one_thread):
    """Every layer of a Wan 2.1 transformer a LoRA can target gets the original ``WanModel``'s name under
    ``diffusion_model.`` (T2V, and the I2V image layers k_img / v_img / img_emb), with ``.alpha`` inside the blocks
    and on patch_embedding (elsewhere diffusers' converter takes none: the scale is folded into lora_B). diffusers'
    converter reads them back into exactly the trained adapter (patch_embedding aside: it has no rule for it)."""
    from diffusers import WanPipeline

    heads, dim = 2, 32
    preset = dict(TINY_WAN, image_dim=32, added_kv_proj_dim=heads * dim)
    model = presets.build_model("wan_i2v", preset=preset, lora={
        "rank": 4, "alpha": 8.0, "target_modules": ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj",
                                                    "ffn.net.0.proj", "ffn.net.2", "linear_1", "linear_2", "time_proj",
                                                    "proj_out", "patch_embedding", "image_embedder.ff.net.0.proj",
                                                    "image_embedder.ff.net.2"]})
    random_adapter(model)
    adapter = lora.adapter_of(model, "transformer", "wan_i2v")
    original = lora.to_original(adapter.layers, WAN_LORA_NAMES, adapter.scale)
    published = {f"blocks.{n}.{layer}" for n in range(2) for layer in (
        "self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.k", "cross_attn.v",
        "cross_attn.o", "cross_attn.k_img", "cross_attn.v_img", "ffn.0", "ffn.2")}
    alpha_free = {"text_embedding.0", "text_embedding.2", "time_embedding.0", "time_embedding.2", "time_projection.1",
                  "head.head", "img_emb.proj.1", "img_emb.proj.3"}
    expected = {f"diffusion_model.{name}.lora_{ab}.weight" for name in published | alpha_free | {"patch_embedding"}
                for ab in "AB"}
    expected |= {f"diffusion_model.{name}.alpha" for name in published | {"patch_embedding"}}
    assert set(original) == expected
    assert all(original[k].item() == 8.0 for k in original if k.endswith(".alpha"))  # scale 2 · rank 4
    # diffusers' converter gives back every trained layer's update exactly
    convertible = {k: v for k, v in original.items() if "patch_embedding" not in k}
    converted = deltas(WanPipeline.lora_state_dict(convertible))
    trained = deltas(adapter.layers, adapter.scale)
    assert converted.keys() == trained.keys() and len(trained) == 2 * 12 + 8
    assert max((converted[k] - trained[k]).abs().max().item() for k in trained) == 0.0


def test_flux_original_names_at_flux1_sizes():
    """FLUX's original layers fuse q, k, v (double blocks: img_attn.qkv, txt_attn.qkv) and a single block's q, k, v
    and MLP input (linear1): the fused adapter is [A_q; A_k; A_v] and diag(B_q, B_k, B_v), alpha = scale · 3r. At
    FLUX.1-dev's widths (3072, MLP 12288; diffusers' converter splits linear1 at exactly those) the converter gives
    back each part's own update, a part not trained (proj_mlp here) as zeros; the final modulation's two halves are
    swapped back. The adapter is random rank 2 (the sizes are the point, not a model)."""
    from diffusers import FluxPipeline

    widths = {  # module: (in, out), FLUX.1-dev
        **{f"transformer_blocks.0.attn.{m}": (3072, 3072) for m in ("to_q", "to_k", "to_v", "add_q_proj",
                                                                     "add_k_proj", "add_v_proj", "to_out.0",
                                                                     "to_add_out")},
        "transformer_blocks.0.ff.net.0.proj": (3072, 12288), "transformer_blocks.0.ff_context.net.2": (12288, 3072),
        "transformer_blocks.0.norm1.linear": (3072, 18432), "transformer_blocks.0.norm1_context.linear": (3072, 18432),
        **{f"single_transformer_blocks.0.attn.{m}": (3072, 3072) for m in ("to_q", "to_k", "to_v")},
        "single_transformer_blocks.0.proj_out": (15360, 3072), "single_transformer_blocks.0.norm.linear": (3072, 9216),
        "x_embedder": (64, 3072), "context_embedder": (4096, 3072), "time_text_embed.timestep_embedder.linear_1":
            (256, 3072), "time_text_embed.guidance_embedder.linear_2": (3072, 3072),
        "time_text_embed.text_embedder.linear_1": (768, 3072), "norm_out.linear": (3072, 6144), "proj_out": (3072, 64),
    }
    generator = torch.Generator().manual_seed(0)
    layers = {}
    for module, (width_in, width_out) in widths.items():
        layers[f"{module}.lora_A.weight"] = torch.randn(2, width_in, generator=generator)
        layers[f"{module}.lora_B.weight"] = torch.randn(width_out, 2, generator=generator)
    original = lora.to_original(layers, FLUX_LORA_NAMES, 2.0, {"single_transformer_blocks.0.proj_mlp": 12288})
    names = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in original}
    assert names == {f"diffusion_model.{name}" for name in (
        "double_blocks.0.img_attn.qkv", "double_blocks.0.txt_attn.qkv", "double_blocks.0.img_attn.proj",
        "double_blocks.0.txt_attn.proj", "double_blocks.0.img_mlp.0", "double_blocks.0.txt_mlp.2",
        "double_blocks.0.img_mod.lin", "double_blocks.0.txt_mod.lin", "single_blocks.0.linear1",
        "single_blocks.0.linear2", "single_blocks.0.modulation.lin", "img_in", "txt_in", "time_in.in_layer",
        "guidance_in.out_layer", "vector_in.in_layer", "final_layer.adaLN_modulation.1", "final_layer.linear")}
    qkv = "diffusion_model.double_blocks.0.img_attn.qkv"
    assert original[f"{qkv}.lora_down.weight"].shape == (6, 3072) and original[f"{qkv}.lora_up.weight"].shape == (
        9216, 6) and original[f"{qkv}.alpha"].item() == 12.0
    linear1 = "diffusion_model.single_blocks.0.linear1"
    assert original[f"{linear1}.lora_up.weight"].shape == (21504, 8) and original[f"{linear1}.alpha"].item() == 16.0
    assert not any(k.startswith("diffusion_model.final_layer") and k.endswith(".alpha") for k in original)
    # diffusers' converter: every part's update back (its non-block layers come without the `transformer.` prefix)
    converted = deltas(FluxPipeline.lora_state_dict(dict(original)))
    trained = deltas(layers, 2.0)
    assert converted.keys() == trained.keys() | {"single_transformer_blocks.0.proj_mlp"}
    assert converted["single_transformer_blocks.0.proj_mlp"].abs().max() == 0
    assert max((converted[k] - trained[k]).abs().max().item() for k in trained) == 0.0


def test_a_layer_without_an_original_name_is_refused_by_name():
    layers = {"blocks.0.norm2.lora_A.weight": torch.zeros(2, 8), "blocks.0.norm2.lora_B.weight": torch.zeros(8, 2)}
    with pytest.raises(ValueError, match=r"no name known here for the LoRA layers \['blocks.0.norm2'\].*"
                                         r"write the diffusers format alone"):
        lora.to_original(layers, WAN_LORA_NAMES, 1.0)


# ---------------------------------------------------------------------- checkpoints and parity
def fit_with_checkpoints(folder, card, size: RunArgs, steps: int = 2, scheduler=None, ema: bool = True,
                         **checkpoint_kwargs):
    """A finetune of ``steps`` iterations (lr 1e-2, EMA 0.9, 4 sampler steps), a checkpoint after each."""
    module = Finetune(card, sampler=FlowMatchSampler(num_steps=4, scheduler=scheduler), caption_dropout=0.0,
                      ema_decay=0.9 if ema else None, run=size)
    callback = ModelCheckpoint(dirpath=str(folder / "checkpoints"), every_n_train_steps=1, save_top_k=-1,
                               save_last=True, **checkpoint_kwargs)
    trainer = quick_trainer(max_steps=steps, default_root_dir=str(folder), enable_checkpointing=True,
                            callbacks=[callback])
    trainer.fit(module, SyntheticVideos(num_samples=8, batch_size=2, frames=size.frames, height=size.height,
                                        width=size.width))
    return module.eval(), str(folder / "checkpoints")


@pytest.fixture(scope="module")
def wan_lora_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan_lora")
    card = wan_card(lr=1e-2)
    card.specs["transformer"].lora = WAN_LORA
    return fit_with_checkpoints(folder, card, RunArgs(frames=5, height=16, width=16))


def round_adapter_to_bf16(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(param.bfloat16().float())


def test_lora_checkpoints_hold_the_adapter_and_both_formats_reproduce_predict(wan_lora_run, tmp_path, one_thread):
    """Every checkpoint of a LoRA run holds ``adapter/`` (both files and adapter.json, in its manifest: verified with
    it): the served adapter (the EMA copy's), bfloat16. Loaded by ``WanPipeline.load_lora_weights`` onto the exported
    base — PEFT keys, and the original Wan names that diffusers converts itself — each reproduces the package's
    sample with the same bfloat16 adapter: max |Δ latents| < 1e-4."""
    from diffusers import WanPipeline

    module, folder = wan_lora_run
    saved = sorted(os.listdir(folder))
    assert saved == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "last.ckpt"]
    for name in saved[:2]:
        manifest = ckpt.verify(os.path.join(folder, name))
        assert sorted(os.listdir(os.path.join(folder, name, "adapter"))) == FILES
        assert {f"adapter/{f}" for f in FILES} <= set(manifest["files"])
    adapter = os.path.join(folder, "last.ckpt", "adapter")
    info = json.load(open(os.path.join(adapter, lora.INFO)))
    assert info["expert"] == "transformer_ema" and info["arch"] == "wan_t2v" and info["pipeline"] == "WanPipeline"
    assert (info["rank"], info["alpha"], info["dtype"]) == (4, 8.0, "bfloat16")
    assert info["target_modules"] == sorted(WAN_LORA.target_modules) and info["base"]["preset"] == TINY_WAN
    with safe_open(os.path.join(adapter, lora.FILES["comfyui"]), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys() if not k.endswith(".alpha")} == {torch.bfloat16}
        assert "diffusion_model.blocks.1.self_attn.o.lora_A.weight" in f.keys()
    with safe_open(os.path.join(adapter, lora.FILES["diffusers"]), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        assert "transformer.blocks.1.attn1.to_out.0.lora_A.weight" in f.keys()

    served = module.card["transformer_ema"]
    ours = module.generate(PROMPTS, seed=3, latents_only=True)
    round_adapter_to_bf16(served)
    ours_bf16 = module.generate(PROMPTS, seed=3, latents_only=True)
    pipe = WanPipeline.from_pretrained(export(os.path.join(folder, "last.ckpt"), str(tmp_path / "base"),
                                              with_base=True, format="diffusers"))
    pipe.unload_lora_weights()
    assert (pipeline_latents(pipe, module, seed=3) - ours).abs().max() > 1e-3  # the base alone: the adapter matters
    gaps = {}
    for fmt, file in lora.FILES.items():
        pipe.load_lora_weights(adapter, weight_name=file)
        latents = pipeline_latents(pipe, module, seed=3)
        gaps[fmt] = (latents - ours_bf16).abs().max().item(), (latents - ours).abs().max().item()
        pipe.unload_lora_weights()
    print("WanPipeline.load_lora_weights(adapter/) vs predict with the bf16 adapter (and with the float32 one): "
          + ", ".join(f"{fmt} {a:.2e} ({b:.2e})" for fmt, (a, b) in gaps.items()))
    assert all(a < 1e-4 for a, _ in gaps.values())
    assert (ours - ours_bf16).abs().max() > 0  # the rounding is real: the comparison must use the same adapter


def pipeline_latents(pipe, module: Finetune, seed: int) -> torch.Tensor:
    """WanPipeline's latents for PROMPTS from the noise ``module.generate(seed=seed)`` starts from."""
    shape = module.stage.latent_shape(module.video)
    noise = torch.randn((len(PROMPTS), *shape), generator=torch.Generator().manual_seed(seed))
    settings = module.serving_settings()
    return pipe(PROMPTS, latents=noise, num_inference_steps=settings["num_inference_steps"],
                guidance_scale=settings["guidance_scale"], max_sequence_length=settings["max_sequence_length"],
                num_frames=module.video.frames, height=module.video.height, width=module.video.width,
                output_type="latent").frames


def test_a_full_finetune_checkpoint_has_no_adapter(tmp_path, one_thread):
    _, folder = fit_with_checkpoints(tmp_path, wan_card(lr=1e-2), RunArgs(frames=5, height=16, width=16), steps=1,
                                     ema=False)
    (name,) = [n for n in os.listdir(folder) if n != "last.ckpt"]
    assert "adapter" not in os.listdir(os.path.join(folder, name))
    ckpt.verify(os.path.join(folder, name))


def test_a_family_without_original_names_writes_the_diffusers_file(tmp_path, one_thread):
    """SD3 declares no original LoRA names: its checkpoints and exports hold the diffusers file alone; asking for the
    comfyui file is refused by export with the fix, and warned once by the checkpoint callback (then left out)."""
    from tests.test_sd3 import sd3_card

    card = sd3_card(lr=1e-2)
    card.specs["transformer"].lora = LoraConfig(rank=4, alpha=4.0)
    with pytest.warns(UserWarning, match=r"sd3 declares no original LoRA key names.*comfyui file is left out"):
        _, folder = fit_with_checkpoints(tmp_path, card, RunArgs(frames=1, height=32, width=32), ema=False,
                                         adapter_formats=["diffusers", "comfyui"])
    for name in ("epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"):
        assert sorted(os.listdir(os.path.join(folder, name, "adapter"))) == [lora.INFO, lora.FILES["diffusers"]]
    last = os.path.join(folder, "last.ckpt")
    assert sorted(os.listdir(export(last, str(tmp_path / "out")))) == [lora.INFO, lora.FILES["diffusers"],
                                                                       "serving.json"]
    with pytest.raises(ValueError, match=r"declares no original LoRA key names.*--format diffusers"):
        export(last, str(tmp_path / "comfy"), format="comfyui")


def test_flux_lora_formats_reproduce_predict(tmp_path, one_thread):
    """FLUX: the fused img / txt qkv of the double blocks, their projections and MLPs, a single block's output layer.
    Not trained here: a single block's q, k, v (diffusers' converter splits linear1 at FLUX.1's widths only; checked
    at those widths above) and the layers outside the blocks (its converter drops their `transformer.` prefix, so
    ``load_lora_weights`` leaves them out; ComfyUI reads them)."""
    from diffusers import FluxPipeline

    from posttrain.modules.models.generators import Flux
    from tests.test_export_generators import flux_scheduler

    card = flux_card(lr=1e-2)
    card.specs["transformer"].lora = LoraConfig(rank=4, alpha=8.0, target_modules=[
        "transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v",
        "add_q_proj", "add_k_proj", "add_v_proj", "attn.to_out.0", "to_add_out", "ff.net.0.proj", "ff_context.net.2",
        "single_transformer_blocks.0.proj_out"])
    size = RunArgs(frames=1, height=32, width=32)
    module, folder = fit_with_checkpoints(tmp_path, card, size, scheduler=flux_scheduler(), ema=False)
    adapter = os.path.join(folder, "last.ckpt", "adapter")
    assert sorted(os.listdir(adapter)) == FILES
    with safe_open(os.path.join(adapter, lora.FILES["comfyui"]), "pt") as f:
        assert "diffusion_model.double_blocks.0.img_attn.qkv.lora_up.weight" in f.keys()
    out = export(os.path.join(folder, "last.ckpt"), str(tmp_path / "base"), with_base=True, format="diffusers")
    pipe = FluxPipeline.from_pretrained(out)
    pipe.unload_lora_weights()
    call = {k: v for k, v in json.load(open(os.path.join(out, "serving.json"))).items()
            if k not in ("pipeline", "transformer")}
    noise = torch.randn((len(PROMPTS), *module.stage.latent_shape(module.video)),
                        generator=torch.Generator().manual_seed(7))
    ours = module.generate(PROMPTS, seed=7, latents_only=True)
    round_adapter_to_bf16(module.card["transformer"])
    ours_bf16 = module.generate(PROMPTS, seed=7, latents_only=True)
    base = Flux.unpack(pipe(PROMPTS, latents=Flux.pack(noise), output_type="latent", **call).images, *ours.shape[-2:])
    assert (base - ours).abs().max() > 1e-3  # the base alone: the adapter matters
    gaps = {}
    for fmt, file in lora.FILES.items():
        pipe.load_lora_weights(adapter, weight_name=file)
        packed = pipe(PROMPTS, latents=Flux.pack(noise), output_type="latent", **call).images
        theirs = Flux.unpack(packed, *ours.shape[-2:])
        gaps[fmt] = (theirs - ours_bf16).abs().max().item(), (theirs - ours).abs().max().item()
        pipe.unload_lora_weights()
    print("FluxPipeline.load_lora_weights(adapter/) vs predict with the bf16 adapter (and with the float32 one): "
          + ", ".join(f"{fmt} {a:.2e} ({b:.2e})" for fmt, (a, b) in gaps.items()))
    assert all(a < 1e-4 for a, _ in gaps.values())


# ---------------------------------------------------------------------- posttrain export
def test_export_writes_the_adapter_alone(wan_lora_run, tmp_path):
    """``posttrain export`` of a LoRA run: the adapter alone (bfloat16, both formats, adapter.json, serving.json) by
    default; ``--format`` picks one file, ``--dtype float32`` keeps float32, ``--with_base true`` adds the pipeline."""
    _, folder = wan_lora_run
    last = os.path.join(folder, "last.ckpt")
    out = tmp_path / "comfy"
    done = launch.posttrain("export", "--ckpt", last, "--out", str(out), "--format", "comfyui", cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(os.listdir(out)) == [lora.INFO, lora.FILES["comfyui"], "serving.json"]
    with safe_open(os.path.join(out, lora.FILES["comfyui"]), "pt") as f:
        assert f.get_tensor("diffusion_model.blocks.0.self_attn.q.lora_A.weight").dtype == torch.bfloat16
    # the same bytes as the checkpoint's own adapter/
    with safe_open(os.path.join(out, lora.FILES["comfyui"]), "pt") as a, \
            safe_open(os.path.join(last, "adapter", lora.FILES["comfyui"]), "pt") as b:
        assert a.keys() == b.keys() and all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
    both = export(last, str(tmp_path / "both"))
    assert sorted(os.listdir(both)) == sorted([*FILES, "serving.json"])
    fp32 = export(last, str(tmp_path / "fp32"), format="diffusers", dtype="float32")
    with safe_open(os.path.join(fp32, lora.FILES["diffusers"]), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}
        metadata = json.loads(f.metadata()["lora_adapter_metadata"])
        assert (metadata["transformer.r"], metadata["transformer.lora_alpha"]) == (4, 8.0)  # its LoraConfig
    base = export(last, str(tmp_path / "base"), with_base=True)
    assert {"model_index.json", "transformer", *FILES} <= set(os.listdir(base))
    # no base weights beside the adapter alone: it is a small fraction of them
    adapter_bytes = sum(os.path.getsize(os.path.join(both, f)) for f in lora.FILES.values())
    base_bytes = os.path.getsize(os.path.join(base, "transformer", "diffusion_pytorch_model.safetensors"))
    print(f"tiny preset: adapter files {adapter_bytes / 1e3:.1f} kB (both formats, bf16) vs the base transformer "
          f"{base_bytes / 1e3:.1f} kB (float32)")
    assert adapter_bytes < base_bytes / 5


def test_adapter_size_of_wan21_13b_at_rank_32():
    """From parameter counts on the meta device (nothing allocated): Wan2.1-T2V-1.3B (dim 1536 = 12 heads × 128,
    FFN 8960, 30 blocks). A rank-r LoRA on a (in → out) layer has r · (in + out) parameters, so per block:
    attention (self and cross; text states are projected to 1536 before the blocks): 8 · 32 · (1536 + 1536) = 786,432;
    FFN: 32 · (1536 + 8960) · 2 = 671,744. 30 blocks: 23,592,960 (attention) and 43,745,280 (+ FFN, the LoRA
    recipe's targets), 47.2 and 87.5 MB in bf16."""
    config = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                  out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
    counts = {}
    for name, targets in (("attention", ["to_q", "to_k", "to_v", "to_out.0"]),
                          ("attention + FFN", ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"])):
        model = presets.build_model("wan_t2v", preset=config, device="meta",
                                    lora={"rank": 32, "alpha": 32.0, "target_modules": targets})
        counts[name] = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
        base = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    assert counts == {"attention": 23_592_960, "attention + FFN": 43_745_280}
    print(f"Wan2.1-T2V-1.3B base {base / 1e9:.3f}B parameters ({2 * base / 1e9:.2f} GB bf16); rank-32 adapter: "
          + ", ".join(f"{name} {n / 1e6:.1f}M ({2 * n / 1e6:.1f} MB bf16, {100 * n / base:.1f}% of the base)"
                      for name, n in counts.items()))
