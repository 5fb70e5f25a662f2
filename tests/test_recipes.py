"""Every real-model recipe in configs/recipes/ parses, builds at the embedded default's size (`--preset tiny`)
and runs two iterations through the real command, so none rots. Their data and learned rewards are local
folders a user downloads once; the test gives the synthetic data and a pixel reward instead."""
from __future__ import annotations

import glob
import json
import os

import pytest
import yaml

import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "configs", "recipes", "*.yaml")))


def nodes(tree):
    """Every mapping in a parsed YAML tree."""
    if isinstance(tree, dict):
        yield tree
        for value in tree.values():
            yield from nodes(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from nodes(value)


@pytest.mark.slow
def test_there_are_recipes_for_the_models_users_start_from():
    names = {os.path.basename(p) for p in RECIPES}
    for expected in ("wan2.1_t2v_1.3b_finetune.yaml", "wan2.1_t2v_1.3b_lora.yaml", "wan2.1_t2v_1.3b_flow_grpo.yaml",
                     "wan2.1_t2v_1.3b_joint_rl.yaml", "wan2.1_t2v_14b_finetune_zero3.yaml", "wan2.1_t2v_14b_lora.yaml",
                     "wan2.1_t2v_14b_finetune_sp8_720p.yaml", "wan2.1_t2v_1.3b_finetune_sp4.yaml",
                     "flux.1_dev_flow_grpo.yaml"):
        assert expected in names


@pytest.mark.slow
@pytest.mark.parametrize("path", RECIPES, ids=[os.path.basename(p) for p in RECIPES])
def test_recipe_runs_two_iterations_at_tiny_size(path, tmp_path):
    with open(path) as f:
        config = yaml.safe_load(f)
    text = open(path).read()
    assert "accelerator: auto" in text and "bf16" in text and "Memory per GPU" in text and "Time per iteration" in text
    assert "gradient_checkpointing: true" in text and "/models/" in text  # real sizes, local folders
    adamw = [node for node in nodes(config) if str(node.get("class_path", "")).endswith("AdamW")]
    assert adamw and all(node["init_args"].get("fused") is True for node in adamw)  # bench/optimizer.py: faster
    method = config["model"]["class_path"]
    if config["data"]["class_path"] == "Prompts":
        data = {"class_path": "Prompts", "init_args": {"num_synthetic": 2, "batch_size": 1}}
    else:
        data = {"class_path": "SyntheticVideos", "init_args": {"num_samples": 4, "batch_size": 2}}
    args = ["fit", "--config", path, "--preset", "tiny", "--trainer.max_steps", "2",
            "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.limit_val_batches", "0",
            "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
            "--data", json.dumps(data)]
    if config["data"]["class_path"] == "Prompts":
        args += ["--data.init_args.path", "null"]  # the same class: its init_args merge with the recipe's
    if "reward" in config["model"]["init_args"]:
        args += ["--model.init_args.reward", "ColourAlignment"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = launch.posttrain(*args, cwd=ROOT, env=env)
    assert done.returncode == 0, f"{method}: {done.stderr[-3000:]}"
    assert os.path.exists(tmp_path / "run" / "checkpoints" / "last.ckpt")
