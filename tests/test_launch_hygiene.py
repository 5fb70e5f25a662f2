"""A launch writes nothing until it is accepted, and says where it looked for what it resumes.

A launch refused at start-up (a card the trainer cannot run, a data folder that is not there, a checkpoint of
another card) leaves the run folder exactly as it was: no W&B run, no ``config.yaml`` rewritten with the refused
values, no new folder, and no "You can sync this run" after the error. ``--ckpt_path last`` with nothing to resume
names the folder it looked in (absolute: ``runs/`` is relative to the working folder) and starts a new run.
"""
from __future__ import annotations

import hashlib
import os

import pytest
import yaml

import launch
from posttrain.lit.tools.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")


def small_finetune(tmp_path, root: str) -> str:
    """configs/finetune.yaml with its W&B logger, 2 iterations, one checkpoint, no validation or samples."""
    with open(os.path.join(CONFIGS, "finetune.yaml")) as f:
        config = yaml.safe_load(f)
    trainer = config["trainer"]
    trainer.update(default_root_dir=root, max_steps=2, val_check_interval=None, limit_val_batches=0,
                   enable_progress_bar=False, enable_model_summary=False)
    trainer["callbacks"] = [c for c in trainer["callbacks"] if "ModelCheckpoint" in c["class_path"]]
    trainer["callbacks"][0]["init_args"]["every_n_train_steps"] = 2
    config["data"]["init_args"].update(num_samples=4, batch_size=2)
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def snapshot(folder: str) -> dict[str, tuple]:
    """Every file, folder and link under ``folder``: its modification time, and its bytes' hash or its target."""
    found = {}
    for parent, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(parent, name)
            stat = os.lstat(path)
            if os.path.islink(path):
                content = os.readlink(path)
            elif os.path.isfile(path):
                with open(path, "rb") as f:
                    content = hashlib.sha256(f.read()).hexdigest()
            else:
                content = "folder"
            found[os.path.relpath(path, folder)] = (stat.st_mtime_ns, content)
    return found


def env(**extra: str) -> dict[str, str]:
    # W&B's own console lines are on (the suite silences them), so that a run started by mistake would say so
    return {**{k: v for k, v in os.environ.items() if k not in ("WANDB_SILENT", "PYTHONWARNINGS")},
            "WANDB_MODE": "offline", **extra}


@pytest.mark.slow
def test_a_refused_launch_leaves_the_run_folder_byte_identical(tmp_path):
    """A finished run (config.yaml, a checkpoint, its offline W&B run), then three relaunches refused at three
    moments of start-up: a card the trainer cannot run (found by the method's setup), a data folder that does not
    exist (the datamodule's setup), a checkpoint of another card (found when it is restored, after the model is
    built). Each ends in its one message; every file, folder and link of the run keeps its bytes and mtime, and no
    W&B run starts (no new wandb folder, no "You can sync this run")."""
    run = str(tmp_path / "run")
    config = small_finetune(tmp_path, run)
    first = launch.posttrain("fit", "--config", config, cwd=str(tmp_path), env=env())
    assert first.returncode == 0, first.stderr[-3000:]
    before = snapshot(run)
    assert "config.yaml" in before and os.path.join("checkpoints", "last.ckpt") in before, sorted(before)
    assert len([p for p in before if p.startswith(os.path.join("wandb", "offline-run-")) and p.count(os.sep) == 1]) == 1

    refused = {
        "sharded expert without a sharding strategy":
            (["--config", config, "--model.init_args.card.experts.transformer.sharded=true"], "trainer.strategy"),
        "missing data folder":
            (["--config", os.path.join(CONFIGS, "finetune_folder.yaml"), f"--trainer.default_root_dir={run}",
              "--trainer.max_steps=2", f"--data.init_args.root={tmp_path / 'nowhere'}"], "--data.init_args.root"),
        "checkpoint of another card":
            (["--config", os.path.join(CONFIGS, "flow_grpo.yaml"), f"--trainer.default_root_dir={run}",
              "--trainer.max_steps=2", "--ckpt_path", "last"], "checkpoint does not match this model card"),
    }
    for name, (args, fragment) in refused.items():
        done = launch.posttrain("fit", *args, cwd=str(tmp_path), env=env())
        said = done.stdout + done.stderr
        assert done.returncode == 2 and "posttrain fit: error:" in done.stderr and fragment in done.stderr, \
            f"{name}: {said[-3000:]}"
        assert "wandb" not in said.lower(), f"{name} started a W&B run: {said[-3000:]}"
        after = snapshot(run)
        assert after == before, f"{name} changed the run folder: " + repr(
            sorted(set(after.items()) ^ set(before.items()))[:6])


@pytest.mark.slow
def test_ckpt_path_last_with_nothing_to_resume_says_where_it_looked(tmp_path):
    """Launched from a folder without the run (``runs/`` is relative to the working folder), ``--ckpt_path last``
    names the absolute folder it looked in and says it starts a new run, in one line; Lightning's note (no last
    checkpoint, "HINT: Set `ModelCheckpoint(..., save_last=True)`") is not shown. ``validate`` asked for the last
    checkpoint and finding none stops with the same folder named."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    config = small_finetune(tmp_path, "runs/finetune")
    looked = os.path.join(str(elsewhere), "runs", "finetune", "checkpoints")
    fit = launch.posttrain("fit", "--config", config, "--ckpt_path", "last", "--trainer.max_steps=1",
                           "--trainer.logger=false", cwd=str(elsewhere), env=env())
    assert fit.returncode == 0, fit.stderr[-3000:]
    said = fit.stdout + fit.stderr
    lines = [line for line in said.splitlines() if "--ckpt_path last" in line]
    assert len(lines) == 1 and f"no checkpoint in {looked}" in lines[0] and "starting a new run" in lines[0] \
        and f"relative to the working folder {elsewhere}" in lines[0], said[-3000:]
    assert "save_last" not in said and "no last checkpoint" not in said, said[-3000:]
    assert os.path.isdir(looked)  # it did start, and checkpointed where it said

    empty = tmp_path / "empty"
    empty.mkdir()
    validate = launch.posttrain("validate", "--config", config, "--ckpt_path", "last", "--trainer.logger=false",
                                cwd=str(empty), env=env())
    message = validate.stderr[validate.stderr.find("posttrain validate: error:"):]
    assert validate.returncode == 2 and os.path.join(str(empty), "runs", "finetune", "checkpoints") in message \
        and "drop --ckpt_path" in message, validate.stderr[-3000:]
    assert os.listdir(empty) == [], os.listdir(empty)


@pytest.mark.skipif(os.path.isdir("/models/Wan2.1-T2V-1.3B-Diffusers"), reason="the recipe's weights are here")
def test_a_recipe_without_its_weights_names_the_download_never_dropping_pretrained(tmp_path, capsys):
    """The Wan2.1-1.3B LoRA recipe on a machine without its folder: the message names the folder, the download
    command with the hub id the recipe's header gives for that folder, and ``scripts/config_folders.py`` (config-only
    folders for ``posttrain estimate``); it never suggests removing ``pretrained``, which would train the tiny preset
    in its place."""
    recipe = os.path.join(CONFIGS, "recipes", "wan2.1_t2v_1.3b_lora.yaml")
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", recipe, f"--trainer.default_root_dir={tmp_path / 'run'}"])
    message = capsys.readouterr().err
    assert exit_.value.code == 2 and len(message.splitlines()) <= 8, message
    assert "pretrained path '/models/Wan2.1-T2V-1.3B-Diffusers' is not a folder" in message, message
    assert ("huggingface-cli download Wan-AI/Wan2.1-T2V-1.3B-Diffusers --local-dir /models/Wan2.1-T2V-1.3B-Diffusers"
            in message), message
    assert "python scripts/config_folders.py --out /models" in message and "<repo>" not in message, message
    assert "remove" not in message and "drop" not in message, message
    assert not os.path.exists(tmp_path / "run")


def test_a_held_logger_starts_no_run_and_makes_no_folder_until_released(tmp_path):
    """What the CLI does with the W&B logger: held, Lightning's touch of ``experiment`` and the hyper-parameters it
    logs before a checkpoint is restored start nothing and make no folder; released, the run starts in the run
    folder with those hyper-parameters."""
    from posttrain.lit.tools.tracking import WandbLogger

    root = tmp_path / "run"
    logger = WandbLogger(save_dir=str(root), offline=True)
    logger.hold()
    _ = logger.experiment
    logger.log_hyperparams({"lr": 1e-3})
    assert not root.exists()
    logger.release()
    try:
        assert (root / "wandb").is_dir() and logger.experiment.config["lr"] == 1e-3
    finally:
        logger.experiment.finish()


@pytest.mark.parametrize("args, said", [
    (["--model.init_args.card.experts.transformer.optimizer.init_args.lr", "1e-3x"],
     "model.init_args.card.experts.transformer.optimizer.init_args.lr: expected type float, got 1e-3x"),
    (["--model.init_args.ema_decy=0.9"], "did you mean `ema_decay`?"),
    (["--trainer.max_step=3"], "--trainer.max_step: no such option; did you mean --trainer.max_steps?"),
    (["--model.init_args.run.sed=3"], "model.init_args.run.sed: RunArgs has no setting `sed`; did you mean `seed`?"),
])
def test_a_refused_key_or_value_is_named_with_its_fix(capsys, tmp_path, args, said):
    """The parser's refusals, read by the CLI: the key as written, the closest valid key at its level or the type
    expected; not jsonargparse's dump (a wrong-typed number was told to be a class path before)."""
    with pytest.raises(SystemExit):
        main(["fit", "--config", os.path.join(CONFIGS, "finetune.yaml"), f"--trainer.default_root_dir={tmp_path}",
              *args])
    err = capsys.readouterr().err
    assert said in err and "class_path" not in err and "Given value" not in err, err
    assert len(err.splitlines()) == 2, err  # the message and the POSTTRAIN_DEBUG line


@pytest.mark.parametrize("config, flat, grouped", [("flow_grpo.yaml", "num_samples_per_prompt", "grpo"),
                                                   ("joint_rl.yaml", "temperature", "refiners"),
                                                   ("dmd2.yaml", "gan_blocks", "gan"),
                                                   ("finetune.yaml", "seed", "run")])
def test_a_key_of_a_group_at_the_methods_level_names_its_new_place(capsys, config, flat, grouped):
    """GRPO's settings, joint RL's refiner settings, DMD2's GAN settings and the run settings each live in a group;
    the flat key names the group's key (one rule for every group: the method's dataclass arguments, and the tables
    of renamed keys)."""
    with pytest.raises(SystemExit):
        main(["fit", "--config", os.path.join(CONFIGS, config), f"--model.init_args.{flat}=1"])
    err = capsys.readouterr().err
    new = {"gan_blocks": "blocks"}.get(flat, flat)
    assert f"`{flat}` is now `{grouped}.{new}`" in err and f"--model.init_args.{grouped}.{new}" in err, err
