"""A run on precomputed rows never loads the text encoder (``Expert.precomputed``): it is built on the meta device,
trains bitwise as the run that loads it, names a prompt it cannot encode, and refuses rows of another source."""
from __future__ import annotations

import json
import os
import shutil
from unittest import mock

import pytest
import torch
import yaml
from lightning.pytorch import Trainer

from posttrain.callbacks.evaluation import Evaluate
from posttrain.callbacks.samples import SampleVideos
from posttrain.datamodules.precomputed import PrecomputedVideos
from posttrain.lit.tools.estimate import estimate
from posttrain.lit.tools.preprocess import preprocess
from posttrain.modules.io import checkpoints as ckpt
from posttrain.modules.models import presets
from posttrain.modules.models.cache import content_hash
from posttrain.modules.models.cards import Expert, LoraConfig, ModelCard
from tests.test_precomputed import method_and_data, small_config, train

ROWS = ("--data", "PrecomputedVideos", "--data.batch_size", "8", "--data.path")


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """(config, folder): configs/finetune.yaml at 16 videos, preprocessed once."""
    tmp = tmp_path_factory.mktemp("rows")
    config = small_config(tmp)
    preprocess(config, str(tmp / "rows"))
    return config, str(tmp / "rows")


@pytest.fixture
def no_encoder_file(monkeypatch):
    """Every way a UMT5 reads its weights from disk fails (``undo()`` lifts it): a run that does not load it does not
    notice."""
    def refuse(*args, **kwargs):
        raise AssertionError("the text encoder's weights were read")

    cls = presets.model_class("umt5")
    monkeypatch.setattr(cls, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr(presets, "load_weights", refuse)
    monkeypatch.setattr(presets, "_streamed", refuse)
    return monkeypatch


def copy_rows(folder: str, tmp_path, name: str, edit) -> str:
    """A copy ``name`` of the rows whose manifest ``edit`` changed (the shards' hashes stay valid)."""
    copy = str(tmp_path / name)
    shutil.copytree(folder, copy)
    path = os.path.join(copy, "manifest.json")
    manifest = json.load(open(path))
    edit(manifest)
    json.dump(manifest, open(path, "w"))
    return copy


def test_fit_on_rows_never_loads_the_encoder_and_trains_bitwise_as_with_it(rows, no_encoder_file, tmp_path):
    config, folder = rows
    model, data = method_and_data(config, *ROWS, folder)
    assert model.card.specs["text_encoder"].precomputed is True  # the CLI's rule: nothing written by the user
    assert model.card.specs["vae"].precomputed is None  # only text encoders
    unloaded = train(model, data)
    encoder = model.card.models["text_encoder"]
    assert all(p.is_meta for p in encoder.parameters()), "the unloaded encoder moved off the meta device"
    assert model.card.cache.hits > 0

    no_encoder_file.undo()
    loaded_model, _ = method_and_data(config, *ROWS, folder,
                                      "--model.init_args.card.experts.text_encoder.precomputed", "false")
    loaded = train(loaded_model, PrecomputedVideos(folder, batch_size=8))
    assert not any(p.is_meta for p in loaded_model.card.models["text_encoder"].parameters())
    assert model.card.versions["transformer"] == loaded_model.card.versions["transformer"] > 0  # both trained
    different = [k for k in loaded if not torch.equal(loaded[k], unloaded[k])]
    assert not different, f"weights differ after 3 steps: {different[:3]}"

    # resume across the switch, both ways: the checkpoint holds none of the encoder's weights
    written = {}
    for name, trained in (("unloaded", model), ("loaded", loaded_model)):
        written[name] = str(tmp_path / f"{name}.ckpt")
        trained.trainer.save_checkpoint(written[name])
        saved = ckpt.load(written[name])
        assert not [k for k in saved["state_dict"] if k.startswith("card.models.text_encoder.")]
        # the same digest either way: the loaded weights', or those the rows were made with (the manifest's)
        assert saved["posttrain"]["frozen"]["text_encoder"]["sha256"] == data.manifest["sources"]["text_encoder"]
    load = "--model.init_args.card.experts.text_encoder.precomputed", "false"
    for path, extra in ((written["unloaded"], load), (written["loaded"], ())):
        again, data = method_and_data(config, *ROWS, folder, *extra)
        fit = Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
        fit.fit(again, datamodule=data, ckpt_path=path)
        assert fit.global_step == 4  # one iteration after the checkpoint's three
        assert all(p.is_meta for p in again.card.models["text_encoder"].parameters()) == (not extra)

    # rows of other encoder weights than the checkpoint's: refused by the resume, before anything loads
    def other_weights(manifest):
        manifest["sources"]["text_encoder"] = "f" * 64
    again, data = method_and_data(config, *ROWS, copy_rows(folder, tmp_path, "other", other_weights))
    with pytest.raises(ValueError, match=r"'text_encoder' \(not loaded: precomputed\) made the rows with other "
                                         r"weights than this checkpoint was trained with"):
        Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False).fit(again, datamodule=data, ckpt_path=written["loaded"])


def test_a_prompt_not_among_the_rows_is_named_with_the_fix(rows, tmp_path):
    config, folder = rows
    model, data = method_and_data(config, *ROWS, folder)
    model.configure_model()
    with pytest.raises(ValueError, match=r"(?s)'text_encoder' is not loaded.*'a prompt never encoded'.*"
                                         r"precomputed false"):
        model.stage.adapter.text(model.stage, ["a prompt never encoded"])
    encoder = model.card["text_encoder"]
    with pytest.raises(ValueError, match="'text_encoder' is not loaded"):  # a direct call too
        encoder(input_ids=torch.zeros(1, 4, dtype=torch.long))

    # a sample prompt the rows lack stops the start, named; the data's own sample prompts come from the rows
    trainer = Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      callbacks=[SampleVideos(prompts=["a prompt never encoded"], write_files=False)])
    with pytest.raises(ValueError, match="'a prompt never encoded'"):
        trainer.fit(model, datamodule=data)
    # the config's own sample prompts were encoded by preprocess; the data's are among its rows
    callbacks = {c["class_path"]: c.get("init_args") for c in yaml.safe_load(open(config))["trainer"]["callbacks"]}
    given = callbacks["SampleVideos"]["prompts"]
    model, data = method_and_data(config, *ROWS, folder)
    evaluated = Evaluate(**callbacks["Evaluate"]).drawn_prompts(data, model.video)
    assert data.split("samples").prompts == list(dict.fromkeys([*evaluated, *given]))
    samplers = [SampleVideos(every_n_iterations=100, prompts=given, write_files=False, num_steps=2),
                SampleVideos(every_n_iterations=100, num_prompts=2, write_files=False, num_steps=2)]
    trainer = Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      default_root_dir=str(tmp_path), callbacks=samplers)
    trainer.fit(model, datamodule=data)  # samples at the end, from the cached rows
    assert samplers[1].prompts == data.sample_prompts(2) and [s._last_sampled for s in samplers] == [1, 1]
    cache = model.card.cache
    cache.max_entries = 1  # the rows the run needs all along stay when the batches' make room
    cache.put("text_encoder", 0, ["x", "y"], torch.zeros(2, 3))
    kept = {key[2] for key in cache.keys_of("text_encoder")}
    assert kept == {content_hash(p) for p in ["", *given, *samplers[1].prompts, "y"]}


def test_rows_of_another_source_or_without_one_are_refused(rows, tmp_path):
    config, folder = rows
    model, data = method_and_data(config, *ROWS, folder, "--model.init_args.card.experts.text_encoder.dtype",
                                  "bfloat16")
    with pytest.raises(ValueError, match=r"expert 'text_encoder' dtype 'bfloat16' \(rows: 'float32'\).*preprocess"):
        train(model, data, steps=1)

    def other_files(manifest):
        manifest["origins"]["text_encoder"]["weights"]["sha256"] = "0" * 64
        manifest["origins"]["text_encoder"]["weights"]["files"] = {}  # its files' times no longer vouch for it
    edited = copy_rows(folder, tmp_path, "other", other_files)
    model, data = method_and_data(config, *ROWS, edited)
    with pytest.raises(ValueError, match=r"'text_encoder' has other weights than the ones the rows were made with "
                                         r"\(the shipped asset: sha256 [0-9a-f]{64} vs rows 0{64}\)"):
        train(model, data, steps=1)

    # rows of an older preprocess, which recorded no source: refused when the encoder is not loaded ...
    old = copy_rows(folder, tmp_path, "old", lambda manifest: manifest.pop("origins"))
    model, data = method_and_data(config, *ROWS, old)
    with pytest.raises(ValueError, match=r"(?s)record no source of expert 'text_encoder'.*`posttrain preprocess "
                                         r"--config .* --overwrite true`"):
        train(model, data, steps=1)
    # ... and still read when it is
    model, data = method_and_data(config, *ROWS, old, "--model.init_args.card.experts.text_encoder.precomputed",
                                  "false")
    train(model, data, steps=1)


def test_estimate_counts_nothing_for_an_encoder_not_loaded(rows, tmp_path):
    config, folder = rows
    raw = yaml.safe_load(open(config))
    raw["data"] = {"class_path": "PrecomputedVideos", "init_args": {"path": folder, "batch_size": 8}}
    precomputed = tmp_path / "precomputed.yaml"
    precomputed.write_text(yaml.safe_dump(raw))
    loaded = estimate(config, devices=1, activations=False)["text_encoder"]
    unloaded = estimate(str(precomputed), devices=1, activations=False)["text_encoder"]
    assert loaded.param_bytes > 0 and loaded.placement == "frozen"
    assert (unloaded.param_bytes, unloaded.host_bytes, unloaded.placement) == (0, 0, "not loaded")
    assert unloaded.params == loaded.params  # the same model, counted, not held


def test_the_card_refuses_precomputed_where_nothing_can_stand_for_the_model():
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-4)  # noqa: E731
    with pytest.raises(ValueError) as refused:
        ModelCard({"text_encoder": Expert(arch="umt5", precomputed=True, trainable=True, optimizer=adamw),
                   "lora_encoder": Expert(arch="umt5", precomputed=True, trainable=True, optimizer=adamw,
                                          lora=LoraConfig(target_modules=["q"])),
                   "vae": Expert(arch="wan_vae", precomputed=True),
                   "sharded": Expert(arch="umt5", precomputed=True, sharded=True),
                   "random": Expert(arch="umt5", preset={"num_layers": 1}, precomputed=True)})
    message = str(refused.value)
    assert "precomputed: true leaves the model unloaded, and 'text_encoder' trains (trainable: true)" in message
    assert "'lora_encoder' trains (a LoRA adapter)" in message
    assert "'wan_vae' is no text encoder" in message
    assert "expert 'sharded': precomputed: true with sharded: true" in message
    assert "'random'" in message and "random preset weights" in message
    card = ModelCard({"text_encoder": Expert(arch="umt5", precomputed=True)})  # the shipped asset: accepted
    with mock.patch.object(presets.model_class("umt5"), "from_pretrained", side_effect=AssertionError("read")):
        card.build()
    assert all(p.is_meta for p in card.models["text_encoder"].parameters())
    card.models.to(torch.float64)  # a move (Lightning's model.to) leaves it as it is
    assert next(card.models["text_encoder"].parameters()).dtype == torch.float32


def test_the_rule_loads_what_no_source_names_and_refuses_precomputed_without_rows(rows, tmp_path):
    config, folder = rows
    random_encoder = small_config(tmp_path, text_encoder={"preset": {"num_layers": 1}})
    model, _ = method_and_data(random_encoder, *ROWS, folder)
    assert model.card.specs["text_encoder"].precomputed is None  # random weights: only the model tells its rows
    with pytest.raises(ValueError, match=r"experts \['text_encoder'\] have precomputed: true.*--data "
                                         r"PrecomputedVideos"):
        method_and_data(config, "--model.init_args.card.experts.text_encoder.precomputed", "true")
