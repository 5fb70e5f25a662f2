"""`posttrain preprocess`: rows encoded once train bitwise as on the fly; wrong or damaged rows are refused."""
from __future__ import annotations

import json
import os
import sys
from unittest import mock

import pytest
import torch
from lightning.pytorch import Trainer

import launch

from posttrain.datamodules.precomputed import PrecomputedVideos
from posttrain.lit.tools.config import PosttrainCLI
from posttrain.lit.tools.preprocess import preprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FINETUNE = os.path.join(ROOT, "configs", "finetune.yaml")


def small_config(tmp_path, **model) -> str:
    """configs/finetune.yaml with 16 training videos (and what ``model`` overrides in the card)."""
    import yaml

    config = yaml.safe_load(open(FINETUNE))
    config["data"]["init_args"].update(num_samples=16, val_samples=4)
    for key, value in model.items():
        config["model"]["init_args"]["card"]["experts"][key].update(value)
    path = tmp_path / f"finetune{'_' + '_'.join(model) if model else ''}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def method_and_data(config: str, *extra: str):
    with mock.patch.object(sys, "argv", sys.argv[:1]):
        cli = PosttrainCLI(args=["--config", config, *extra], run=False)
    return cli.model, cli.datamodule


def train(model, data, steps: int = 3) -> dict[str, torch.Tensor]:
    trainer = Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(model, datamodule=data)
    return {k: v.clone() for k, v in model.card["transformer"].state_dict().items()}


@pytest.mark.slow
def test_training_on_precomputed_rows_is_bitwise_training_on_the_fly(tmp_path):
    config = small_config(tmp_path)
    out = tmp_path / "rows"
    assert "train 16, val 4 rows (1 process)" in preprocess(config, str(out))
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["sources"]) == {"vae", "text_encoder"}

    on_the_fly = train(*method_and_data(config))
    model, data = method_and_data(config)
    rows = PrecomputedVideos(str(out), batch_size=data.batch_size)  # the config's batch, as on the fly
    encoder = model.card.specs["text_encoder"]
    calls = []
    with mock.patch("posttrain.modules.models.generators.wan.umt5_embeds", side_effect=lambda *a: calls.append(a)):
        precomputed = train(model, rows)
    assert not calls, "the text encoder ran although every row was precomputed"
    assert encoder.trainable is False
    start = method_and_data(config)[0]
    start.configure_model()
    moved = [k for k, v in on_the_fly.items() if not torch.equal(v, start.card["transformer"].state_dict()[k])]
    assert moved, "3 steps changed nothing: the comparison below would be empty"
    different = [k for k in on_the_fly if not torch.equal(on_the_fly[k], precomputed[k])]
    assert not different, f"weights differ after 3 steps: {different[:3]}"


@pytest.mark.slow
def test_two_processes_write_one_shard_each_with_the_same_rows(tmp_path, monkeypatch):
    """Each process takes half the cores, and the VAE's CPU kernels then sum in another order: latents agree
    to float32 rounding (bitwise equality holds at equal threads, as in the test above); text rows exactly."""
    monkeypatch.setattr(torch.multiprocessing, "spawn", launch.forked_spawn)  # processes forked, not cold
    config = small_config(tmp_path)
    assert "train 16, val 4 rows (2 processes)" in preprocess(config, str(tmp_path / "two"), processes=2)
    preprocess(config, str(tmp_path / "one"))
    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert [f["rows"] for f in manifest["splits"]["train"]["files"]] == [8, 8]
    one = PrecomputedVideos(str(tmp_path / "one")).split("train")
    two = PrecomputedVideos(str(tmp_path / "two")).split("train")
    assert two.prompts == one.prompts and torch.equal(two.text["text_encoder"], one.text["text_encoder"])
    torch.testing.assert_close(two.latents, one.latents, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_rows_of_other_weights_or_size_are_refused_and_damage_is_named(tmp_path):
    config = small_config(tmp_path)
    out = tmp_path / "rows"
    preprocess(config, str(out))
    with pytest.raises(FileExistsError, match="--overwrite true"):
        preprocess(config, str(out))

    # another text encoder (random preset weights instead of the shipped asset)
    other = small_config(tmp_path, text_encoder={"preset": {"num_layers": 1}})
    model, _ = method_and_data(other)
    with pytest.raises(ValueError, match="expert 'text_encoder' has other weights.*posttrain preprocess"):
        train(model, PrecomputedVideos(str(out), batch_size=4), steps=1)

    # another video size
    model, _ = method_and_data(config, "--model.init_args.run.height", "64", "--model.init_args.run.width", "64")
    with pytest.raises(ValueError, match=r"video size \(frames, height, width\) \(5, 64, 64\)"):
        train(model, PrecomputedVideos(str(out), batch_size=4), steps=1)

    # a damaged shard
    shard = out / "train-00000-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    model, _ = method_and_data(config)
    with pytest.raises(ValueError, match="does not match its SHA-256"):
        train(model, PrecomputedVideos(str(out), batch_size=4), steps=1)

    with pytest.raises(FileNotFoundError, match="not a folder written by `posttrain preprocess"):
        PrecomputedVideos(str(tmp_path / "nothing"))


@pytest.mark.slow
def test_rl_reads_precomputed_prompt_rows_without_running_the_text_encoder(tmp_path):
    config = os.path.join(ROOT, "configs", "flow_grpo.yaml")
    preprocess(config, str(tmp_path / "rows"))
    manifest = json.loads((tmp_path / "rows" / "manifest.json").read_text())
    assert manifest["video"] is None and set(manifest["sources"]) == {"text_encoder"}  # prompts only
    model, _ = method_and_data(config)
    calls = []
    with mock.patch("posttrain.modules.models.generators.wan.umt5_embeds", side_effect=lambda *a: calls.append(a)):
        train(model, PrecomputedVideos(str(tmp_path / "rows"), batch_size=2), steps=1)
    assert not calls and model.card.cache.hits > 0
