"""A checkpoint of another card is refused before anything loads. (Kills at any instant and bitwise-exact
resume: tests/test_kill_anywhere.py.)"""
from __future__ import annotations

import pytest
import torch

from posttrain.datamodules.synthetic import SyntheticVideos
from posttrain.lit.finetune import Finetune
from posttrain.modules.models.cards import Expert
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


def test_a_checkpoint_of_another_method_is_summarised():
    """Resuming a finetune checkpoint with a Self-Forcing-like card (another generator, a critic, a teacher, five
    refiners): nine experts differ. The refusal says how many, shows the first three, names the other six and
    says what to do, in six lines (it listed all nine, eleven lines)."""
    from posttrain.lit.engine.resume import check_signature
    from posttrain.modules.models.cards import ModelCard

    finetune = wan_card()
    saved = finetune.signature() | {"transformer_ema": {"role_of": "transformer", "role": "ema"}}
    student = Expert(arch="wan_t2v_causal", trainable=True, optimizer=adamw())
    other = ModelCard({"text_encoder": Expert(arch="umt5"), "vae": Expert(arch="wan_vae"), "transformer": student,
                       "critic": Expert(arch="wan_t2v", trainable=True, optimizer=adamw()),
                       "teacher": Expert(arch="wan_t2v")},
                      num_refiners=5, refiner=Expert(arch="qwen2", trainable=True, optimizer=adamw()))
    with pytest.raises(ValueError) as refused:
        check_signature(saved, other.signature())
    lines = str(refused.value).splitlines()
    assert "(9 expert(s) differ); nothing was loaded" in lines[0], lines
    assert len(lines) == 6 and lines[1].startswith("  - the card has expert 'critic'"), lines
    assert lines[4] == "  - and 6 more: 'refiner_2', 'refiner_3', 'refiner_4', 'teacher', 'transformer', " \
                       "'transformer_ema'", lines
    assert lines[5] == "Resume with the config the checkpoint was trained with, or start a new run.", lines
