"""A checkpoint of another card is refused before anything loads. (Kills at any instant and bitwise-exact
resume: tests/test_kill_anywhere.py.)"""
from __future__ import annotations

import pytest
import torch

from posttrain.datamodules.synthetic import SyntheticVideos
from posttrain.lit.finetune import Finetune
from posttrain.modules.cards import Expert
from tests.conftest import TINY_WAN, adamw, wan_card
from tests.helpers import quick_trainer



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
