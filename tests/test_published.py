"""The published architectures as a card builds them (``Expert.published``, ``modules/models/published.py``): every
component at its published parameter count, random weights that are a function of the card alone, the settings a
card refuses, ``--random_weights true`` on the recipes, and the real Wan2.1-T2V-1.3B trained for one LoRA iteration
on the CPU through the recipe and exported to diffusers' ``WanPipeline``."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest
import torch
import yaml

from posttrain.modules.models import presets
from posttrain.modules.models import published as catalog
from posttrain.modules.models.cards import Expert, ModelCard, ZeroConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE_1_3B_LORA = os.path.join(ROOT, "configs", "recipes", "wan2.1_t2v_1.3b_lora.yaml")

# Parameters of every component as ``from_pretrained`` of the hub folder builds it. Published figures they match:
# Wan2.1-T2V-1.3B 1.42B ("1.3B"), 14B 14.29B, FLUX.1-dev 11.90B ("12B"), T5-XXL encoder 4.76B, UMT5-XXL encoder
# 5.68B, CLIP-L text 123M, OpenCLIP bigG text 695M, Qwen2.5-0.5B 494M ("0.49B"). SD3.5 Medium's MMDiT-X counts
# 2.24B here; Stability's "2.5B" counts more than the diffusers transformer.
COUNTS = {
    ("Wan2.1-T2V-1.3B", "transformer"): 1_418_996_800,
    ("Wan2.1-T2V-1.3B", "vae"): 126_892_531,
    ("Wan2.1-T2V-1.3B", "text_encoder"): 5_680_910_336,
    ("Wan2.1-T2V-14B", "transformer"): 14_288_491_584,
    ("Wan2.1-T2V-14B", "vae"): 126_892_531,
    ("Wan2.1-T2V-14B", "text_encoder"): 5_680_910_336,
    ("Wan2.1-I2V-14B", "transformer"): 16_394_878_784,
    ("Wan2.1-I2V-14B", "vae"): 126_892_531,
    ("Wan2.1-I2V-14B", "text_encoder"): 5_680_910_336,
    ("Wan2.1-I2V-14B", "image_encoder"): 630_766_080,
    ("Wan2.2-T2V-A14B", "transformer"): 14_288_491_584,  # two noise experts of the 14B layout
    ("Wan2.2-T2V-A14B", "transformer_2"): 14_288_491_584,
    ("Wan2.2-T2V-A14B", "vae"): 126_892_531,
    ("Wan2.2-T2V-A14B", "text_encoder"): 5_680_910_336,
    ("Wan2.2-TI2V-5B", "transformer"): 4_999_787_712,  # "5B"
    ("Wan2.2-TI2V-5B", "vae"): 704_688_668,  # the Wan 2.2 VAE (48 latent channels)
    ("Wan2.2-TI2V-5B", "text_encoder"): 5_680_910_336,
    ("FLUX.1-dev", "transformer"): 11_901_408_320,
    ("FLUX.1-dev", "vae"): 83_819_683,
    ("FLUX.1-dev", "text_encoder"): 123_060_480,
    ("FLUX.1-dev", "text_encoder_2"): 4_762_310_656,
    ("SD3.5-medium", "transformer"): 2_243_171_520,
    ("SD3.5-medium", "vae"): 83_819_683,
    ("SD3.5-medium", "text_encoder"): 123_650_304,
    ("SD3.5-medium", "text_encoder_2"): 694_659_840,
    ("SD3.5-medium", "text_encoder_3"): 4_762_310_656,
    ("Qwen2.5-0.5B-Instruct", ""): 494_032_768,
    ("Qwen-Image", "transformer"): 20_430_401_088,  # "20B"
    ("Qwen-Image", "vae"): 126_892_531,  # Wan 2.1's VAE layout
    ("Qwen-Image", "text_encoder"): 8_292_166_656,  # Qwen2.5-VL-7B-Instruct's 8.29B, the vision tower 0.68B of it
}


def test_every_published_component_is_counted():
    assert set(COUNTS) == {(name, sub) for name, model in catalog.PUBLISHED.items() for sub in model.components}


@pytest.mark.parametrize("name, subfolder", sorted(COUNTS), ids=[f"{n}/{s}" for n, s in sorted(COUNTS)])
def test_published_component_builds_on_meta_with_its_parameter_count(name, subfolder):
    arch = catalog.PUBLISHED[name].components[subfolder][0]
    model = presets.build_model(arch, subfolder=subfolder or None, published=name, device="meta")
    assert sum(p.numel() for p in model.parameters()) == COUNTS[(name, subfolder)]


def test_the_arch_picks_the_component_and_the_subfolder_where_it_does_not():
    assert catalog.component("FLUX.1-dev", "t5") == "text_encoder_2"
    assert catalog.component("Wan2.1-T2V-14B", "wan_t2v_causal") == "transformer"  # a subclass, the same config
    with pytest.raises(ValueError, match=r"has 2 'clip_projection' components \(text_encoder, text_encoder_2\): "
                                         r"give the expert's `subfolder`"):
        catalog.component("SD3.5-medium", "clip_projection")
    assert catalog.component("SD3.5-medium", "clip_projection", "text_encoder_2") == "text_encoder_2"
    with pytest.raises(ValueError, match="has no 'wan_vae' component; its components are transformer: flux"):
        catalog.component("FLUX.1-dev", "wan_vae")
    with pytest.raises(ValueError, match="subfolder 'vae' is a 'vae_kl', not arch 'flux'"):
        catalog.component("FLUX.1-dev", "flux", "vae")


@torch.no_grad()
def test_random_weights_are_a_function_of_the_model_the_component_and_the_module(one_thread):
    one = presets.build_model("wan_t2v", published="Wan2.1-T2V-1.3B", preset={"num_layers": 1}, dtype=torch.bfloat16)
    again = presets.build_model("wan_t2v", published="Wan2.1-T2V-1.3B", preset={"num_layers": 1}, dtype=torch.bfloat16)
    two = presets.build_model("wan_t2v", published="Wan2.1-T2V-1.3B", preset={"num_layers": 2}, dtype=torch.bfloat16)
    state, deeper = one.state_dict(), two.state_dict()
    assert all(torch.equal(value, again.state_dict()[key]) for key, value in state.items())  # a resume rebuilds it
    assert all(torch.equal(value, deeper[key]) for key, value in state.items())  # --layers N: the first N blocks
    assert not torch.equal(deeper["blocks.0.attn1.to_q.weight"], deeper["blocks.1.attn1.to_q.weight"])
    # the class's float32 modules stay float32; norms start at one; the rotary tables are computed, not random
    assert state["scale_shift_table"].dtype == torch.float32 and state["blocks.0.attn1.to_q.weight"].dtype == torch.bfloat16
    assert torch.equal(state["blocks.0.attn1.norm_q.weight"], torch.ones_like(state["blocks.0.attn1.norm_q.weight"]))
    freqs = dict(one.named_buffers())["rope.freqs_cos"]
    assert freqs[0].eq(1).all() and freqs.abs().max() <= 1  # cos(0) = 1 at position 0
    assert all(torch.isfinite(value.float()).all() for value in state.values())
    # Wan's modulation table as its constructor draws it: randn / sqrt(dim)
    assert abs(state["scale_shift_table"].std().item() - 1536 ** -0.5) < 0.002
    other = presets.build_model("wan_t2v", published="Wan2.1-T2V-14B", preset={"num_layers": 1, "num_attention_heads": 12,
                                                                                "ffn_dim": 8960})
    assert other.state_dict()["blocks.0.attn1.to_q.weight"].shape == state["blocks.0.attn1.to_q.weight"].shape
    assert not torch.equal(other.state_dict()["blocks.0.attn1.to_q.weight"].bfloat16(), state["blocks.0.attn1.to_q.weight"])


def card(**transformer) -> ModelCard:
    return ModelCard({"transformer": Expert(arch="wan_t2v", **transformer)})


def test_a_card_refuses_published_beside_pretrained_an_unknown_name_and_a_foreign_component(tmp_path):
    with pytest.raises(ValueError) as err:
        card(published="Wan2.1-T2V-1.3B", pretrained=str(tmp_path))
    assert (f"both pretrained={str(tmp_path)!r} and published='Wan2.1-T2V-1.3B'" in str(err.value)
            and "--model.init_args.card.experts.transformer.published null" in str(err.value))
    with pytest.raises(ValueError, match=r"published='Wan2.1-T2V-2B' is not a published model this package knows; "
                                         r"choose one of Wan2.1-T2V-1.3B, Wan2.1-T2V-14B, Wan2.1-I2V-14B, .*FLUX.1-dev"):
        card(published="Wan2.1-T2V-2B")
    with pytest.raises(ValueError, match="published='FLUX.1-dev' has no 'wan_t2v' component"):
        card(published="FLUX.1-dev")
    with pytest.raises(ValueError, match="with ZeRO-3"):
        card(published="Wan2.1-T2V-1.3B", sharded=True, zero=ZeroConfig(stage=3))


def test_a_missing_pretrained_folder_still_names_the_download_and_never_builds_a_preset(tmp_path):
    missing = str(tmp_path / "Wan2.1-T2V-1.3B-Diffusers")
    with pytest.raises(ValueError) as err:
        card(pretrained=missing, subfolder="transformer")
    assert f"--local-dir {missing}" in str(err.value) and "scripts/config_folders.py" in str(err.value)


def test_random_weights_turns_every_recipe_folder_into_its_published_model():
    from posttrain.lit.tools.config import parse

    config = parse(RECIPE_1_3B_LORA, random_weights=True)
    experts = config.model.init_args.card.init_args.experts
    assert {name: (e.published, e.pretrained, e.subfolder) for name, e in experts.items()} == {
        "text_encoder": ("Wan2.1-T2V-1.3B", None, "text_encoder"), "vae": ("Wan2.1-T2V-1.3B", None, "vae"),
        "transformer": ("Wan2.1-T2V-1.3B", None, "transformer")}
    assert experts["text_encoder"].tokenizer is None  # its folder does not exist here: ByT5 ids
    assert parse(RECIPE_1_3B_LORA).model.init_args.card.init_args.experts["vae"].published is None  # asked only


def test_random_weights_and_the_tiny_preset_do_not_combine(capsys):
    from posttrain.lit.tools.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", RECIPE_1_3B_LORA, "--preset", "tiny", "--random_weights", "true"])
    assert stop.value.code == 2
    assert "`--preset tiny` builds every expert from its tiny preset" in capsys.readouterr().err


def test_random_weights_refuses_a_folder_name_it_does_not_know(tmp_path):
    recipe = yaml.safe_load(open(RECIPE_1_3B_LORA))
    recipe["model"]["init_args"]["card"]["experts"]["vae"]["pretrained"] = "/models/MyVAE"
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    from posttrain.lit.tools.config import parse

    with pytest.raises(ValueError, match=r"its folder name 'MyVAE' is no published model this package knows.*"
                                         r"known folder names: Wan2.1-T2V-1.3B-Diffusers, Wan2.1-T2V-14B-Diffusers"):
        parse(str(path), random_weights=True)


def test_estimate_with_random_weights_sizes_the_recipe_at_real_size(capsys):
    from posttrain.lit.tools.cli import main
    from posttrain.lit.tools.estimate import estimate

    table = estimate(RECIPE_1_3B_LORA, devices=8, activations=False, random_weights=True)
    assert table["transformer"].params - table["transformer"].trainable == COUNTS[("Wan2.1-T2V-1.3B", "transformer")]
    assert table["text_encoder"].params == COUNTS[("Wan2.1-T2V-1.3B", "text_encoder")]
    main(["estimate", "--config", RECIPE_1_3B_LORA, "--devices", "8", "--activations", "false",
          "--random_weights", "true"])
    assert str(table) in capsys.readouterr().out


def test_the_bench_trains_one_block_of_wan_1_3b(one_thread):
    from bench.real_size import run_case

    result = run_case("wan1.3b_lora", iterations=2, layers=1)
    # one block of the published widths: 1536 wide, 12 heads, ffn 8960; rank-32 LoRA on its 6 kinds of layer
    assert result["params"] - result["trainable"] == 72_216_384
    assert result["trainable"] == 32 * (8 * (1536 + 1536) + 2 * (1536 + 8960))  # self- and cross-attention, FFN
    assert all(torch.isfinite(torch.tensor(result["losses"])))
    assert 0 < result["checkpoint_bytes"] < 3 * 4 * result["trainable"] + 2**20  # weights + 2 AdamW moments


def fit_config(tmp_path) -> str:
    """The 1.3B LoRA recipe for one CPU iteration at 5 frames x 64 x 64: a small text encoder of UMT5-XXL's width
    (the transformer reads 4096-wide rows), the synthetic clips, a checkpoint every iteration, no samples."""
    recipe = yaml.safe_load(open(RECIPE_1_3B_LORA))
    init = recipe["model"]["init_args"]
    init["card"]["experts"]["text_encoder"] = {"arch": "umt5", "preset": {"d_model": 4096}, "dtype": "bfloat16"}
    init["run"] = {"frames": 5, "height": 64, "width": 64}
    recipe["trainer"].update(accelerator="cpu", devices=1, strategy="auto", max_steps=1, logger=False,
                             limit_val_batches=0, num_sanity_val_steps=0, enable_progress_bar=False,
                             default_root_dir=str(tmp_path / "run"))
    recipe["trainer"]["callbacks"] = [{"class_path": "posttrain.callbacks.checkpoints.ModelCheckpoint",
                                       "init_args": {"every_n_train_steps": 1, "save_last": True}}]
    recipe["data"] = {"class_path": "SyntheticVideos", "init_args": {"num_samples": 2, "batch_size": 1}}
    path = tmp_path / "wan2.1_t2v_1.3b_lora_cpu.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


@pytest.mark.slow
def test_real_wan_1_3b_trains_one_lora_iteration_on_the_cpu_and_exports_to_wan_pipeline(tmp_path):
    config = fit_config(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "posttrain", "fit", "--config", config, "--random_weights", "true"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    # CI runs two test workers in 24 GB: one real 1.3B iteration (bf16 base) stays well inside its share
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 < 8 * 2**30
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert ckpt.exists()
    size = sum(f.stat().st_size for f in ([ckpt] if ckpt.is_file() else ckpt.rglob("*")) if f.is_file())
    assert size < 2**30  # the adapter and its AdamW state; the 2.8 GB bf16 base is rebuilt from its seed
    # a resume rebuilds the base from the published seed, checks its digest and trains on
    done = subprocess.run([sys.executable, "-m", "posttrain", "fit", "--config", config, "--random_weights", "true",
                           "--ckpt_path", "last", "--trainer.max_steps", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step=2" in " ".join(os.listdir(tmp_path / "run" / "checkpoints")), os.listdir(tmp_path / "run" / "checkpoints")
    out = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "posttrain", "export", "--ckpt", str(ckpt), "--out", str(out),
                           "--with_base", "true", "--dtype", "bfloat16"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(out), dtype=torch.bfloat16)
    assert sum(p.numel() for p in pipe.transformer.parameters()) == COUNTS[("Wan2.1-T2V-1.3B", "transformer")]
    pipe.load_lora_weights(str(out))
    adapter = json.loads((out / "adapter.json").read_text())
    assert adapter["rank"] == 32


def test_every_recipe_says_how_far_it_was_verified():
    import glob

    levels = ("ran at real size on CPU", "ran on a GPU", "estimated only")
    for path in glob.glob(os.path.join(ROOT, "configs", "recipes", "*.yaml")):
        header = [line for line in open(path) if line.startswith("# Verified: ")]
        assert len(header) == 1 and header[0][len("# Verified: "):].startswith(levels), (path, header)
