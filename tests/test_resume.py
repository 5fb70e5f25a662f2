"""Exact resume: a run SIGKILLed mid-training and resumed with `--ckpt_path last` ends bitwise equal
to an uninterrupted run; a checkpoint of another card is refused before anything loads."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
import yaml

from posttrain.datamodules.synthetic import SyntheticVideos
from posttrain.lit.finetune import Finetune
from posttrain.modules.cards import Expert
from tests.conftest import TINY_WAN, adamw, wan_card
from tests.helpers import quick_trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_config(tmp_path, name: str, kill_at: int | None = None) -> str:
    with open(os.path.join(ROOT, "configs", "finetune.yaml")) as f:
        config = yaml.safe_load(f)
    run = tmp_path / name
    trainer = config["trainer"]
    trainer.update(max_steps=9, val_check_interval=None, check_val_every_n_epoch=1, limit_val_batches=1,
                   enable_progress_bar=False)
    trainer["default_root_dir"] = str(run)
    trainer["callbacks"] = [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(run / "checkpoints"), "every_n_train_steps": 3, "save_last": True}},
    ]
    if kill_at is not None:
        trainer["callbacks"].append({"class_path": "tests.helpers.KillAt", "init_args": {"iteration": kill_at}})
    # 5 batches an epoch: the checkpoint at iteration 3 is mid-epoch and the run crosses an epoch
    config["data"]["init_args"].update(num_samples=10, val_samples=2, batch_size=2)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def posttrain(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "WANDB_MODE": "offline"}
    return subprocess.run([sys.executable, "-m", "posttrain", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_sigkill_and_resume_is_bitwise_exact(tmp_path):
    straight = posttrain("fit", "--config", write_config(tmp_path, "straight"))
    assert straight.returncode == 0, straight.stderr[-3000:]

    killed = posttrain("fit", "--config", write_config(tmp_path, "killed", kill_at=4))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    ckpts = sorted(os.listdir(tmp_path / "killed" / "checkpoints"))
    assert "last.ckpt" in ckpts and not any("step=6" in c for c in ckpts)  # died after step 3's save

    resumed = posttrain("fit", "--config", write_config(tmp_path, "killed"), "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    a = torch.load(tmp_path / "straight" / "checkpoints" / "last.ckpt", weights_only=False)
    b = torch.load(tmp_path / "killed" / "checkpoints" / "last.ckpt", weights_only=False)
    assert a["global_step"] == b["global_step"] == 9
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), f"{key} differs after resume"
    for sa, sb in zip(a["optimizer_states"], b["optimizer_states"]):
        for pid, state in sa["state"].items():
            assert all(torch.equal(state[k], sb["state"][pid][k]) for k in state)
    assert a["posttrain_versions"] == b["posttrain_versions"]
    assert a["posttrain_versions"]["transformer"] == 9 and a["posttrain_versions"]["transformer_ema"] == 9
    # the same run without resume would have restarted at step 0: prove resume really continued
    assert "Restoring states from the checkpoint" in resumed.stderr + resumed.stdout


def test_checkpoint_of_another_card_is_refused_whole(tmp_path):
    module = Finetune(wan_card(), caption_dropout=0.0)
    trainer = quick_trainer(max_steps=2, default_root_dir=tmp_path)
    trainer.fit(module, SyntheticVideos(num_samples=8, batch_size=2))
    path = tmp_path / "two.ckpt"
    trainer.save_checkpoint(path)

    other = Finetune(wan_card(extra={"critic": Expert(arch="wan_t2v", preset=TINY_WAN, trainable=True,
                                                      optimizer=adamw())}),
                     caption_dropout=0.0)
    other.configure_model()
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match=r"(?s)does not match this model card.*'critic'.*the checkpoint does not"):
        quick_trainer(max_steps=4).fit(other, SyntheticVideos(num_samples=8, batch_size=2), ckpt_path=path)
    after = other.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items()), "a refused checkpoint changed weights"
