"""A table of bad inputs, each through the real ``posttrain`` command (in-process): every one ends in one short
message (``posttrain <cmd>: error: ...``) that names the option or file and says what to do, before anything is
trained, and the checkpoints already in the run's folder stay byte-identical.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil

import pytest
import yaml

from posttrain.modules.io import checkpoints as ckpt
from posttrain.lit.tools.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")


def small(config: str, run: str) -> list[str]:
    return ["--config", os.path.join(CONFIGS, config), "--trainer.max_steps=2", "--trainer.logger=false",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
            f"--trainer.default_root_dir={run}"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A finished 2-iteration finetune (its checkpoints are what no bad input may touch) and bad files."""
    base = tmp_path_factory.mktemp("bad")
    run = str(base / "run")
    main(["fit", *small("finetune.yaml", run), "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0",
          "--data.init_args.num_samples=4", "--data.init_args.batch_size=2"])
    files = base / "files"
    (files / "empty_folder").mkdir(parents=True)
    (files / "bad_captions").mkdir()
    from PIL import Image

    for i in range(2):
        Image.new("RGB", (32, 32)).save(files / "bad_captions" / f"v{i}.png")
        (files / "bad_captions" / f"v{i}.txt").write_text("a red circle")
    (files / "bad_captions" / "v1.txt").write_bytes(b"\xff\xfe a caption \x80")
    (files / "empty.txt").write_text("\n\n")
    (files / "bad_mp4").mkdir()  # a video that is not one: ffmpeg's error comes with its banner and build flags
    (files / "bad_mp4" / "clip.mp4").write_bytes(b"\x00\x01 not really a video" * 10)
    (files / "bad_mp4" / "clip.txt").write_text("a red circle")
    (files / "empty_png").mkdir()
    (files / "empty_png" / "still.png").write_bytes(b"")
    for folder in ("bad_mp4", "empty_png"):  # and a readable item beside it (the shipped val_fraction holds one out)
        Image.new("RGB", (32, 32)).save(files / folder / "good.png")
        (files / folder / "good.txt").write_text("a blue square")
    (files / "empty_png" / "still.txt").write_text("a red circle")
    (files / "bad_metadata").mkdir()
    Image.new("RGB", (32, 32)).save(files / "bad_metadata" / "a.png")
    (files / "bad_metadata" / "metadata.jsonl").write_text('{"file": "a.png", "caption": "a red circle"}\n'
                                                           "{file: 'a.png', caption: 'a blue square'}\n")
    (files / "bad.jsonl").write_text('{"prompt": "a red circle"}\n{prompt: "a blue square"}\n')
    (files / "typo.yaml").write_text("modle:\n  class_path: Finetune\n")
    (files / "typo_trainer.yaml").write_text("trainer:\n  max_step: 3\n")
    (files / "syntax.yaml").write_text("trainer:\n  max_steps: [1\n")
    (files / "out_used").mkdir()
    (files / "out_used" / "mine.txt").write_text("mine")
    return {"run": run, "files": str(files), "last": os.path.join(run, "checkpoints", "last.ckpt")}


def fingerprint(folder: str) -> dict[str, str]:
    found = {}
    for parent, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(parent, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return found


F, G = "finetune.yaml", "flow_grpo.yaml"
M = "--model.init_args."
NO_FILTER = "--data.init_args.exclude=[]"  # flow_grpo.yaml trains on seen concepts: its filter is of synthetic captions
# (id, command, config or None, extra arguments, fragments the message must hold: the option/file, the fix)
CASES = [
    ("max_steps 0", "fit", F, ["--trainer.max_steps=0"], ["trainer.max_steps=0", "set trainer.max_steps"]),
    ("frames not 4k+1", "fit", F, [M + "run.frames=6"], ["frames=6", "4k+1", "e.g. 9"]),
    ("height not a multiple", "fit", F, [M + "run.height=30"], ["height=30", "must be a multiple of", "e.g. 32"]),
    ("width not a multiple", "fit", F, [M + "run.width=21"], ["width=21", "must be a multiple of", "e.g. 24"]),
    ("text_max_length 0", "fit", F, [M + "card.text_max_length=0"], ["text_max_length=0", "must be >= 1"]),
    ("negative learning rate", "fit", F, [M + "card.experts.transformer.optimizer.init_args.lr=-1"],
     ["expert 'transformer' optimizer", "learning rate", "model.card.experts.transformer.optimizer.init_args"]),
    ("misspelt top-level flag", "fit", F, ["--trainr.max_steps=3"], ["--trainr.max_steps", "did you mean --trainer"]),
    ("misspelt top-level YAML key", "fit", F, ["--config", "{files}/typo.yaml"], ["modle", "did you mean --model"]),
    ("misspelt nested key", "fit", F, [M + "card.experts.transformer.optimiser=null"],
     ["optimiser", "did you mean `optimizer`"]),
    ("wrong value type", "fit", F, ["--trainer.max_steps=many"], ["trainer.max_steps", "expected type int, got many"]),
    ("wrong-typed learning rate", "fit", F, [M + "card.experts.transformer.optimizer.init_args.lr", "1e-3x"],
     ["model.init_args.card.experts.transformer.optimizer.init_args.lr: expected type float, got 1e-3x"]),
    ("misspelt trainer flag", "fit", F, ["--trainer.max_step=3"],
     ["--trainer.max_step", "did you mean --trainer.max_steps"]),
    ("misspelt trainer YAML key", "fit", F, ["--config", "{files}/typo_trainer.yaml"],
     ["trainer.max_step", "did you mean --trainer.max_steps"]),
    ("misspelt method setting", "fit", F, [M + "ema_decy=0.9"],
     ["model.init_args.ema_decy", "did you mean `ema_decay`"]),
    ("misspelt expert setting", "fit", F, [M + "card.experts.transformer.trainble=true"],
     ["model.init_args.card.experts.transformer.trainble", "did you mean `trainable`"]),
    ("misspelt ZeRO setting", "fit", F, [M + "card.experts.transformer.zero.stag=3"],
     ["zero.stag", "did you mean `stage`"]),
    ("misspelt optimizer argument", "fit", F, [M + "card.experts.transformer.optimizer.init_args.lrr=3"],
     ["optimizer.init_args.lrr", "AdamW has no setting `lrr`", "did you mean `lr`"]),
    ("GRPO setting at its former place", "fit", G, [M + "num_samples_per_prompt", "1"],
     ["`num_samples_per_prompt` is now `grpo.num_samples_per_prompt`",
      "--model.init_args.grpo.num_samples_per_prompt"]),
    ("choice not in its list", "fit", G, [M + "grpo.advantage_std=grop"],
     ["model.init_args.grpo.advantage_std: expected one of group, global, got grop", "did you mean group"]),
    ("unknown arch", "fit", F, [M + "card.experts.transformer.arch=wan_xl"], ["wan_xl", "wan_t2v"]),
    ("trainable without optimizer", "fit", F, [M + "card.experts.text_encoder.trainable=true"],
     ["'text_encoder' is trainable but has no optimizer", "add"]),
    ("optimizer on a frozen expert", "fit", F, [M + "card.experts.transformer.trainable=false"],
     ["'transformer' has an optimizer or scheduler but trainable=false", "set `trainable: true`"]),
    ("pretrained folder missing", "fit", F, [M + "card.experts.transformer.pretrained={files}/nowhere"],
     ["expert 'transformer'", "nowhere", "give a local folder", "huggingface-cli download <repo> --local-dir",
      "scripts/config_folders.py"]),
    ("pretrained folder of another class", "fit", F,
     [M + "card.experts.transformer.pretrained=" + os.path.join(ROOT, "modules", "assets", "wan_vae")],
     ["expert 'transformer'", "holds a AutoencoderKLWan", "point `pretrained`"]),
    ("missing --ckpt_path", "fit", F, ["--ckpt_path", "{files}/nope.ckpt"], ["nope.ckpt", "does not exist", "last"]),
    ("checkpoint of another expert set", "fit", G, ["--ckpt_path", "{last}"], ["transformer_ema", "Resume with the config the checkpoint was trained with"]),
    ("missing config file", "fit", None, ["--config", "{files}/nope.yaml"], ["nope.yaml", "does not exist", "configs/"]),
    ("YAML syntax error", "fit", None, ["--config", "{files}/syntax.yaml"], ["syntax.yaml:3", "invalid YAML"]),
    ("batch_size 0", "fit", F, ["--data.init_args.batch_size=0"], ["batch_size=0", "must be >= 1"]),
    ("no samples", "fit", F, ["--data.init_args.num_samples=0"], ["num_samples=0", "must be >= 1", "e.g. 64"]),
    ("missing data folder", "fit", "finetune_folder.yaml", ["--data.init_args.root={files}/no_folder"],
     ["no_folder", "does not exist", "--data.init_args.root"]),
    ("empty data folder", "fit", "finetune_folder.yaml", ["--data.init_args.root={files}/empty_folder"],
     ["empty_folder", "holds no media", "put videos or images there"]),
    ("caption not UTF-8", "fit", "finetune_folder.yaml", ["--data.init_args.root={files}/bad_captions"],
     ["v1.txt", "not UTF-8", "save it as UTF-8"]),
    ("corrupt video in a folder", "fit", "finetune_folder.yaml",
     ["--data.init_args.root={files}/bad_mp4", "--data.init_args.repeat_images=true",
      "--data.init_args.strict=true",
      "--data.init_args.latents_cache={files}/latents"],
     ["clip.mp4: cannot read this media file", "Invalid data", "re-encode its source", "or remove it"]),
    ("zero-byte image in a folder", "fit", "finetune_folder.yaml",
     ["--data.init_args.root={files}/empty_png", "--data.init_args.repeat_images=true",
      "--data.init_args.strict=true",
      "--data.init_args.latents_cache=null"],
     ["still.png: cannot read this media file", "empty: 0 bytes", "readable PNG or JPEG", "or remove it"]),
    ("metadata line not JSON", "fit", "finetune_folder.yaml", ["--data.init_args.root={files}/bad_metadata"],
     ["metadata.jsonl:2: not valid JSON", 'one JSON object', '{"file": "clips/a.mp4", "caption": "']),
    ("prompts line not JSON", "fit", G, ["--data.init_args.path={files}/bad.jsonl", NO_FILTER],
     ["bad.jsonl:2: not valid JSON", "one JSON object", '{"prompt": "', "one prompt per line"]),
    ("predict with no inline prompts", "predict", G, ["--data.init_args.prompts=[]", NO_FILTER],
     ["inline `prompts` list is empty", "--data.init_args.prompts='[", "path: prompts.txt", "synthetic captions"]),
    ("data size beside the run's", "fit", F, ["--data.init_args.frames=9"],
     ["data.init_args.frames=9 but model.init_args.run.frames=5", "set once", "drop data.init_args.frames"]),
    ("empty prompts file", "fit", G, ["--data.init_args.path={files}/empty.txt", NO_FILTER], ["empty.txt", "holds no prompts", "one prompt per line"]),
    ("missing prompts file", "fit", G, ["--data.init_args.path={files}/none.txt", NO_FILTER], ["none.txt", "does not exist", "leave it null"]),
    ("sampler without steps", "fit", F, [M + "sampler.init_args.num_steps=0"], ["num_steps=0", "must be >= 1", "e.g. 20"]),
    ("negative SDE noise", "fit", G, [M + "sampler.init_args.noise_level=-1"], ["noise_level=-1", "must be >= 0"]),
    ("non-positive shift", "fit", F, [M + "sampler.init_args.scheduler.init_args.shift=-3"], ["shift=-3", "> 0"]),
    ("EMA decay above 1", "fit", F, [M + "ema_decay=1.5"], ["ema_decay=1.5", "null turns EMA off"]),
    ("caption dropout above 1", "fit", F, [M + "caption_dropout=2"], ["caption_dropout=2", "e.g. 0.1"]),
    ("GRPO group of one", "fit", G, [M + "grpo.num_samples_per_prompt=1"], ["grpo.num_samples_per_prompt=1", "uses 8 to 24"]),
    ("negative clip range", "fit", G, [M + "grpo.clip_range=-0.1"], ["grpo.clip_range=-0.1", "the default is 1e-3"]),
    ("unknown reward class", "fit", G, [M + "reward.class_path=NoSuchReward"], ["NoSuchReward", "full import path"]),
    ("validate a missing checkpoint", "validate", F, ["--ckpt_path", "{files}/nope.ckpt"], ["nope.ckpt", "does not exist", "--ckpt_path last"]),
    ("export a missing checkpoint", "export", None, ["--ckpt", "{files}/nope.ckpt", "--out", "{files}/o1"],
     ["nope.ckpt", "does not exist", "written by `posttrain fit`"]),
    ("export an unknown expert", "export", None, ["--ckpt", "{last}", "--out", "{files}/o2", "--expert", "transfomer"],
     ["transfomer", "transformer_ema"]),
    ("export into a used folder", "export", None, ["--ckpt", "{last}", "--out", "{files}/out_used"],
     ["out_used", "not empty", "--overwrite true"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,command,config,extra,fragments", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_one_short_message_and_touches_no_checkpoint(world, capsys, name, command, config, extra,
                                                                    fragments):
    before = fingerprint(os.path.join(world["run"], "checkpoints"))
    args = [command, *(small(config, world["run"]) if config else [])]
    args += [a.format(**world) for a in extra]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    message = err[err.index(f"posttrain {command}: error:"):]
    assert len(message.splitlines()) <= 8 and "Traceback" not in message, message
    for fragment in fragments:
        assert fragment in message, f"{name}: {fragment!r} not in {message!r}"
    assert fingerprint(os.path.join(world["run"], "checkpoints")) == before, f"{name} changed the run's checkpoints"


def test_battery_size():
    assert len(CASES) >= 30


def test_full_disk_during_a_checkpoint_write_keeps_the_earlier_ones(world, tmp_path, monkeypatch):
    """ENOSPC while ``lightning.pt`` is written: the write stops with the folder named and the fix, its temporary
    folder is removed, and the earlier checkpoints (and ``last``) are as they were."""
    folder = tmp_path / "checkpoints"
    shutil.copytree(os.path.join(world["run"], "checkpoints"), folder, symlinks=True)
    before, last = fingerprint(str(folder)), ckpt.last_target(str(folder))

    def full(*_, **__):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "save_state", full)
    with pytest.raises(ckpt.CheckpointError, match=r"No space left on device.*earlier checkpoints are unchanged.*Free "
                                                   r"space in .*--ckpt_path last"):
        ckpt.write_checkpoint({"global_step": 4, "state_dict": {}}, str(folder / "epoch=1-step=4.ckpt"))
    assert fingerprint(str(folder)) == before and ckpt.last_target(str(folder)) == last
    assert not [n for n in os.listdir(folder) if n.startswith(ckpt.TEMP_PREFIX)]


@pytest.mark.slow
def test_a_reward_that_returns_nan_is_named(world, capsys):
    """A reward returning NaN for some videos stops the run at its first rollout with the reward named."""
    config = os.path.join(os.path.dirname(world["files"]), "nan_reward.yaml")
    with open(os.path.join(CONFIGS, G)) as f:
        cfg = yaml.safe_load(f)
    cfg["model"]["init_args"]["reward"] = {"class_path": "tests.helpers.NaNReward"}
    with open(config, "w") as f:
        yaml.safe_dump(cfg, f)
    args = ["fit", "--config", config, *small(G, os.path.join(os.path.dirname(world["files"]), "nan_run"))[2:]]
    with pytest.raises(SystemExit):
        main(args)
    message = capsys.readouterr().err
    assert "NaNReward" in message and "not finite" in message, message
