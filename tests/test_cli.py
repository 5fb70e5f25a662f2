"""The command a user types: subcommands, one run folder, W&B runs, a quiet console, short errors."""
from __future__ import annotations

import glob
import io
import os
import re
import subprocess
import sys
from unittest import mock

import pytest
import yaml

import launch
from posttrain.lit.tools.cli import condense, main
from posttrain.lit.tools.config import PosttrainCLI, derive_run_folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FINETUNE = os.path.join(ROOT, "configs", "finetune.yaml")


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def test_help_lists_what_runs(capsys):
    """fit / validate / predict / export / estimate / preprocess / reward / serve-reward; no `test` (no method has a test_step); no top-level optimizer."""
    code, out, _ = run_main(capsys, "--help")
    assert code == 0
    commands = re.search(r"\{([a-z,-]+)\}", out).group(1).split(",")
    assert commands == ["fit", "validate", "predict", "export", "estimate", "preprocess", "reward", "serve-reward"]
    # it opens with what posttrain does, then one line per command (not Lightning's "Trainer command line tool")
    opening = out.split("\n\n")[1]
    assert opening.startswith("posttrain post-trains video and image generators"), out
    assert "Lightning Trainer command line tool" not in out
    described = re.findall(r"^  ([a-z-]+)  ", out.split("options:")[0], flags=re.MULTILINE)
    assert described == commands, out
    code, out, _ = run_main(capsys, "fit", "--help")
    assert "--optimizer" not in out and "--lr_scheduler" not in out and "--model.help" in out


@pytest.mark.parametrize("args, expected", [
    (["--model.init_args.card.experts.transformer.trainable=false"],
     "expert 'transformer' has an optimizer or scheduler but trainable=false"),
    (["--trainr.max_steps=3"], "did you mean --trainer.max_steps"),
    (["--trainer.max_steps=many"], "max_steps"),
    (["--model.init_args.card.experts.transformer.arch=wan_xl"], "wan_xl"),
])
def test_errors_are_one_short_message(capsys, args, expected):
    """The package's own message first and alone (option and fix); no traceback, no Union dump."""
    code, _, err = run_main(capsys, "fit", "--config", FINETUNE, *args)
    assert code == 2
    assert err.startswith("posttrain fit: error: ") and expected in err, err
    assert "Traceback" not in err and "Union subtypes" not in err and "Given value" not in err
    assert len(err.splitlines()) <= 8, err


@pytest.mark.parametrize("config, old, new", [("unified_rl.yaml", "refiner_kl", "refiners.kl_beta"),
                                               ("joint_rl.yaml", "num_skip_refinement", "refiners.num_unrefined"),
                                               ("dmd2.yaml", "gan_critic_weight", "gan.critic_weight"),
                                               ("dmd2.yaml", "regression_weight", "regression.weight"),
                                               ("flow_grpo.yaml", "num_samples_per_prompt",
                                                "grpo.num_samples_per_prompt")])
def test_a_flat_key_of_before_names_its_new_place(capsys, tmp_path, config, old, new):
    """joint_rl's refiner settings, dmd2's GAN and regression settings and the GRPO settings live in groups
    (``refiners:``, ``gan:``, ``regression:``, ``grpo:``): a config or a flag that still sets the old flat key fails
    with one message naming its place."""
    old_yaml = tmp_path / "old.yaml"
    old_yaml.write_text(yaml.safe_dump({"model": {"init_args": {old: 0}}}))
    for extra in (["--config", str(old_yaml)], [f"--model.init_args.{old}=0"]):
        code, _, err = run_main(capsys, "fit", "--config", os.path.join(ROOT, "configs", config), *extra)
        assert code == 2 and f"`{old}` is now `{new}`" in err, err


def test_on_a_terminal_the_error_starts_its_own_line(monkeypatch):
    """A progress bar holds the terminal's last line (no newline after it), so on a terminal the message starts a
    fresh line; piped, it is the first thing written, as above."""
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with pytest.raises(SystemExit):
        main(["fit", "--config", FINETUNE, "--trainr.max_steps=3"])
    assert terminal.getvalue().startswith("\nposttrain fit: error: "), terminal.getvalue()


def test_yaml_syntax_error_names_the_file_and_line(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_steps: 3\n   devices: [1\n")
    code, _, err = run_main(capsys, "fit", "--config", str(bad))
    assert code == 2 and f"{bad}:3:" in err, err


@pytest.mark.slow
def test_debug_flag_shows_the_traceback(tmp_path):
    env = {**os.environ, "POSTTRAIN_DEBUG": "1"}
    done = subprocess.run([sys.executable, "-m", "posttrain", "fit", "--config", FINETUNE,
                           "--model.init_args.card.experts.transformer.trainable=false"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" in done.stderr


@pytest.mark.slow
def test_the_error_path_stands_down_lightnings_child_watcher_and_waits_for_the_children():
    """On the launching process, Lightning's child-process watcher SIGKILLs it once a child exits non-zero (here
    0.5 s in, polled every 0.1 s); the error path stands the watcher down and waits for the children, so the process
    lives to exit on its own, with the child's code known. Run in a subprocess: the broken path kills its process."""
    script = """
import os, subprocess, sys, time
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from posttrain.lit.tools import cli
child = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(0.5); sys.exit(2)"])
_ChildProcessObserver(main_pid=os.getpid(), child_processes=[child], sleep_period=0.1).start()
children = cli._stand_down_child_observer()
cli._await(children, timeout=30.0)
time.sleep(1.5)  # past the watcher's next polls
print("alive", [c.returncode for c in children])
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "alive [2]" in done.stdout, (done.returncode, done.stdout, done.stderr[-2000:])


def test_condense_keeps_the_key_and_the_message():
    message = ('Parser key "model":\n  Does not validate against any of the Union subtypes\n  Subtypes: [<class '
               "'x'>]\n  Errors:\n    - Problem with given class_path 'posttrain.lit.Finetune':\n        Parser key "
               '"run":\n          - Expected a <class \'NoneType\'>\n          frames must be an int\n  Given value: 3')
    assert condense(message) == "model.run: frames must be an int"


def test_one_run_folder_setting():
    """default_root_dir fills the logger's folder, name and job type and the checkpoint folder."""
    from jsonargparse import Namespace

    trainer = Namespace(default_root_dir="runs/x", logger=Namespace(class_path="posttrain.lit.tools.tracking.WandbLogger",
                                                                    init_args=Namespace()),
                        callbacks=[Namespace(class_path="ModelCheckpoint", init_args=Namespace(dirpath=None))])
    derive_run_folder(trainer, "validate", None)
    assert trainer.callbacks[0].init_args.dirpath == os.path.join("runs/x", "checkpoints")
    args = trainer.logger.init_args
    assert (args.save_dir, args.name, args.job_type) == ("runs/x", "x-validate", "validate")


def small_config(tmp_path) -> str:
    """configs/finetune.yaml as it is, shortened: 4 iterations, a checkpoint, validation and samples every 2."""
    with open(FINETUNE) as f:
        config = yaml.safe_load(f)
    trainer = config["trainer"]
    trainer.update(default_root_dir=str(tmp_path / "run"), max_steps=4, val_check_interval=2, limit_val_batches=1,
                   log_every_n_steps=2)
    for callback in trainer["callbacks"]:
        args = callback.setdefault("init_args", {})
        for key in ("every_n_train_steps", "every_n_iterations"):
            if key in args:
                args[key] = 2
    config["data"]["init_args"].update(num_samples=12, batch_size=2)
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def posttrain(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS",)}
    return subprocess.run([sys.executable, "-m", "posttrain", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def forked(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS",)}
    return launch.posttrain(*args, cwd=str(cwd), env=env, timeout=300)


def warnings_in(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if re.search(r"[Ww]arning|WARNING|deprecated", line)]


@pytest.mark.slow
def test_default_run_prints_no_warning_and_resumes_its_wandb_run(tmp_path):
    """The default finetune (shortened) through the real command: fit, resume with --ckpt_path last,
    validate and predict print no warning; the progress bar counts iterations up to max_steps; the resumed fit
    continues the first run's W&B run. The first fit starts cold (its imports' warnings count too); the other three
    are forks of a pre-imported process (tests/launch.py), which print what they do after their imports."""
    config = small_config(tmp_path)
    first = posttrain("fit", "--config", config, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert warnings_in(first.stderr) == [], first.stderr
    assert "component" in first.stderr and "transformer_ema" in first.stderr  # one summary row per expert
    bar = re.findall(r"iteration: .*", first.stdout)[-1]  # the bar's last state: iterations, learning rate, loss
    assert re.search(r"100%.*\| 4/4 .*lr/transformer=.*loss=", bar), first.stdout[-2000:]
    resumed = forked("fit", "--config", config, "--ckpt_path", "last", "--trainer.max_steps", "6", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert warnings_in(resumed.stderr) == [], resumed.stderr
    assert re.search(r"\| 6/6 ", re.findall(r"iteration: .*", resumed.stdout)[-1]), resumed.stdout[-2000:]
    validated = forked("validate", "--config", config, "--ckpt_path", "last", cwd=tmp_path)
    assert validated.returncode == 0 and warnings_in(validated.stderr) == [], validated.stderr
    runs = sorted(os.listdir(tmp_path / "run" / "wandb"))
    ids = [name.rsplit("-", 1)[-1] for name in runs if name.startswith("offline-run-")]
    assert len(ids) == 3 and ids[0] == ids[1] and ids[2] != ids[0], runs  # fit, resumed fit, validate
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == sorted(
        ["last.ckpt", "epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt"])
    predicted = forked("predict", "--config", config, "--ckpt_path", "last", "--data.init_args.num_samples", "2",
                       cwd=tmp_path)
    assert predicted.returncode == 0 and warnings_in(predicted.stderr) == [], predicted.stderr


# ---------------------------------------------------------------------- one video size
SIZE = ("frames", "height", "width")


class ParseOnly(PosttrainCLI):
    def instantiate_classes(self) -> None:  # the config as the command reads it (links, --preset); nothing built
        pass

    def _set_seed(self) -> None:  # leave the global RNGs alone
        pass


def read_config(*args: str):
    with mock.patch.object(sys, "argv", sys.argv[:1]):
        return ParseOnly(args=list(args), run=False, parser_kwargs={"exit_on_error": False}).config


@pytest.mark.slow
def test_run_frames_override_reaches_the_synthetic_data(tmp_path):
    """`--model.init_args.run.frames=9` on configs/finetune.yaml: the data trains on 9-frame videos, the size the
    method samples (before, SyntheticVideos silently kept its own 5)."""
    with mock.patch.object(sys, "argv", sys.argv[:1]):
        cli = PosttrainCLI(args=["fit", "--config", FINETUNE, "--model.init_args.run.frames=9",
                                 "--trainer.max_steps=1", "--trainer.logger=false", "--trainer.limit_val_batches=0",
                                 "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
                                 f"--trainer.default_root_dir={tmp_path / 'run'}", "--data.init_args.num_samples=2",
                                 "--data.init_args.batch_size=2"])
    assert cli.trainer.global_step == 1
    video = next(iter(cli.datamodule.train_dataloader()))["video"]
    assert tuple(video.shape[2:]) == (9, 32, 32) == (cli.model.video.frames, cli.model.video.height,
                                                     cli.model.video.width)


@pytest.mark.slow
def test_every_shipped_config_has_one_video_size():
    """Every shipped config whose data has a size parses to the run's size (as it means; the recipes' VideoFolder
    used to fall back to 9x32x32 and finetune_flux's images to 5 frames), and `--preset tiny` keeps it one."""
    paths = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")) +
                   glob.glob(os.path.join(ROOT, "configs", "recipes", "*.yaml")))
    checked = []
    for path in paths:
        with open(path) as f:
            raw = yaml.safe_load(f)
        if (raw.get("data") or {}).get("class_path") not in ("SyntheticVideos", "VideoFolder"):
            continue
        config = read_config("--config", path)
        run, data = config.model.init_args.run, config.data.init_args
        assert [data[k] for k in SIZE] == [raw["model"]["init_args"]["run"][k] for k in SIZE] == \
            [run[k] for k in SIZE], path
        checked.append(os.path.basename(path))
    assert {"finetune.yaml", "finetune_flux.yaml", "finetune_folder.yaml", "wan2.1_t2v_1.3b_finetune.yaml"} <= \
        set(checked), checked
    tiny = read_config("--config", os.path.join(ROOT, "configs", "recipes", "wan2.1_t2v_1.3b_finetune.yaml"),
                       "--preset", "tiny")
    run, data = tiny.model.init_args.run, tiny.data.init_args
    assert [data[k] for k in SIZE] == [run[k] for k in SIZE] == [9, 32, 32]


def test_a_data_size_other_than_the_runs_is_refused_with_both_named(tmp_path):
    """A linked init argument given in the YAML is replaced silently by jsonargparse; a size that can only have
    been written there is refused instead (one equal to the run's is fine)."""
    with open(FINETUNE) as f:
        config = yaml.safe_load(f)
    config["data"]["init_args"].update(frames=9, height=32)
    path = tmp_path / "two_sizes.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(Exception) as err:
        read_config("--config", str(path))
    message = condense(str(err.value))
    assert message.startswith("data.init_args.frames=9 but model.init_args.run.frames=5: the video size is set once"), \
        message
    assert "drop data.init_args.frames" in message and "height" not in message, message
