"""Checkpoints hold what training changes: a frozen expert read from a file (``pretrained``, a shipped asset) is
left out, a resume reloads it from there, and a source that changed since is refused by name."""
from __future__ import annotations

import os

import pytest
import torch

from posttrain.callbacks.checkpoints import ModelCheckpoint
from posttrain.datamodules.synthetic import SyntheticVideos
from posttrain.modules.io import checkpoints as ckpt
from posttrain.lit.base import RunArgs
from posttrain.lit.finetune import Finetune
from posttrain.modules.models import presets
from posttrain.modules.models.cards import Expert, ModelCard
from tests.conftest import adamw
from tests.helpers import fit_checkpointed, quick_trainer

SIZE = dict(frames=5, height=16, width=16)


def card(umt5: str) -> ModelCard:
    return ModelCard(experts={"text_encoder": Expert(arch="umt5", pretrained=umt5), "vae": Expert(arch="wan_vae"),
                              "transformer": Expert(arch="wan_t2v", trainable=True, optimizer=adamw(1e-3))},
                     text_max_length=16)


def fit(folder, umt5: str, steps: int, ckpt_path=None):
    torch.manual_seed(0)
    module = Finetune(card(umt5), caption_dropout=0.0, ema_decay=0.9, run=RunArgs(**SIZE))
    fit_checkpointed(module, folder, steps, ckpt_path)
    return module


@pytest.fixture
def umt5(tmp_path) -> str:
    """A 4-layer UMT5 as a local pretrained folder (the frozen text encoder a real card reads from disk)."""
    torch.manual_seed(1)
    folder = str(tmp_path / "umt5")
    presets.build_model("umt5", preset={"num_layers": 4, "d_ff": 256}).save_pretrained(folder)
    return folder


def test_frozen_experts_from_files_are_left_out_and_reloaded(tmp_path, umt5):
    folder = tmp_path / "ckpt"
    fit(folder, umt5, 2)
    state = ckpt.load(str(folder / "last.ckpt"))
    experts = {key.split(".")[2] for key in state["state_dict"]}
    assert experts == {"transformer", "transformer_ema"}  # text encoder and VAE come from their files
    assert set(state["posttrain"]["frozen"]) == {"text_encoder", "vae"}
    assert state["posttrain"]["frozen"]["text_encoder"]["source"]["pretrained"] == umt5

    resumed = fit(folder, umt5, 4, ckpt_path="last")
    straight = fit(tmp_path / "straight", umt5, 4)
    for (name, a), (_, b) in zip(resumed.state_dict().items(), straight.state_dict().items()):
        assert torch.equal(a, b), f"{name} differs between the resumed and the uninterrupted run"


def test_a_changed_frozen_source_is_refused(tmp_path, umt5):
    folder = tmp_path / "ckpt"
    fit(folder, umt5, 2)
    encoder = presets.build_model("umt5", pretrained=umt5)
    with torch.no_grad():
        encoder.shared.weight[0, 0] += 1.0
    encoder.save_pretrained(umt5)
    with pytest.raises(ValueError, match=r"frozen expert 'text_encoder' is not the one this checkpoint was trained "
                                         r"with: its source \(.*umt5\) changed since .*Restore that source"):
        fit(folder, umt5, 4, ckpt_path="last")


def test_checkpoint_size_without_the_frozen_experts(tmp_path, umt5, monkeypatch):
    """Leaving the frozen experts out shrinks a checkpoint by exactly their weights (give or take pickling and tied tensors)."""
    after = fit(tmp_path / "after", umt5, 2)
    monkeypatch.setattr(ModelCard, "reloadable", lambda self: [])  # the old behaviour: every expert saved
    fit(tmp_path / "before", umt5, 2)
    size = {k: os.path.getsize(tmp_path / k / "last.ckpt" / ckpt.STATE) for k in ("before", "after")}
    frozen = sum(t.numel() * t.element_size() for n in ("text_encoder", "vae")
                 for t in after.card.models[n].state_dict().values())
    print(f"checkpoint with every expert {size['before']:,} B, without the frozen ones {size['after']:,} B "
          f"(ratio {size['before'] / size['after']:.2f}); frozen weights {frozen:,} B")
    assert abs(size["before"] - size["after"] - frozen) < 0.05 * frozen, (size, frozen)  # tied weights: once


def test_keep_last_retains_the_newest_checkpoints(tmp_path, umt5):
    folder = tmp_path / "ckpt"
    torch.manual_seed(0)
    module = Finetune(card(umt5), caption_dropout=0.0, ema_decay=None, run=RunArgs(**SIZE))
    callback = ModelCheckpoint(dirpath=str(folder), every_n_train_steps=2, save_last=True, save_top_k=-1, keep_last=2)
    quick_trainer(8, enable_checkpointing=True, callbacks=[callback]).fit(
        module, SyntheticVideos(num_samples=8, batch_size=2, **SIZE))
    kept = sorted(n for n in os.listdir(folder) if n.startswith("epoch="))
    assert kept == ["epoch=1-step=6.ckpt", "epoch=1-step=8.ckpt"], kept
    assert os.path.basename(ckpt.last_target(str(folder))) == "epoch=1-step=8.ckpt"
    with pytest.raises(ValueError, match=r"keep_last=0 must be >= 1"):
        ModelCheckpoint(keep_last=0)
