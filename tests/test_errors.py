"""Bad input gets a clear error naming the problem and the fix, and nothing is lost."""
from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Callback

import launch
from posttrain.datamodules.synthetic import SyntheticVideos
from posttrain.lit.base import NonFiniteLossError
from posttrain.lit.tools.config import PosttrainCLI
from posttrain.lit.finetune import Finetune
from posttrain.modules.models.cards import Expert, ModelCard
from posttrain.modules.models.presets import build_model
from tests.conftest import TINY_WAN, adamw, wan_card
from tests.helpers import TwoExperts, quick_trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FINETUNE = os.path.join(ROOT, "configs", "finetune.yaml")


def cli_error(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        PosttrainCLI(args=["fit", "--config", FINETUNE, *args], run=False)
    assert exit_info.value.code != 0
    return capsys.readouterr().err


def test_unknown_config_key(capsys):
    err = cli_error(capsys, "--model.init_args.card.experts.transformer.trainabel=true")
    assert "trainabel" in err


def test_wrong_type(capsys):
    err = cli_error(capsys, "--trainer.max_steps=many")
    assert "max_steps" in err and "many" in err


def test_unknown_arch(capsys):
    err = cli_error(capsys, "--model.init_args.card.experts.transformer.arch=wan_xl")
    assert "wan_xl" in err


def test_card_problems_are_collected_into_one_message(tmp_path):
    with pytest.raises(ValueError) as info:
        ModelCard(experts={
            "transformer": Expert(arch="wan_t2v", trainable=True),  # no optimizer
            "vae": Expert(arch="wan_vae", pretrained=str(tmp_path / "missing")),
            "bad.name": Expert(arch="umt5"),
        }, num_refiners=2)
    message = str(info.value)
    assert "'transformer' is trainable but has no optimizer" in message
    assert "missing" in message and "is not a folder" in message
    assert "'bad.name'" in message
    assert "num_refiners=2 needs a `refiner:` expert template" in message


def test_method_names_missing_experts():
    card = ModelCard(experts={"vae": Expert(arch="wan_vae"),
                              "transformer": Expert(arch="wan_t2v")})
    with pytest.raises(ValueError) as info:
        Finetune(card)
    assert "the card has no 'text_encoder'" in str(info.value)
    assert "set `trainable: true`" in str(info.value)


def test_unknown_component_lookup(tiny_card):
    with pytest.raises(KeyError, match="no component 'critic'"):
        tiny_card["critic"]


def test_pretrained_folder_loads_real_weights(tmp_path):
    """`pretrained:` loads what `save_pretrained` wrote, exactly (the path real checkpoints take)."""
    torch.manual_seed(3)
    source = build_model("wan_t2v")
    source.save_pretrained(tmp_path / "wan")
    card = ModelCard(experts={"transformer": Expert(arch="wan_t2v", pretrained=str(tmp_path / "wan"))})
    card.build()
    loaded = card["transformer"].state_dict()
    assert all(torch.equal(v, loaded[k]) for k, v in source.state_dict().items())
    assert not any(p.requires_grad for p in card["transformer"].parameters())  # frozen, eval
    assert not card["transformer"].training


def test_pretrained_folder_of_the_wrong_class(tmp_path):
    build_model("umt5").save_pretrained(tmp_path / "te")
    card = ModelCard(experts={"transformer": Expert(arch="wan_t2v", pretrained=str(tmp_path / "te"))})
    with pytest.raises(ValueError, match=r"could not load 'wan_t2v' from pretrained="):
        card.build()


def test_pretrained_and_init_from_together_are_refused_by_name(tmp_path):
    """init_from copies another expert's weights after the build, so beside `pretrained:` it would silently replace
    the folder's weights (a progressive DMD2 stage whose student came back as the teacher): refused, naming both and
    the command-line flag that drops one, which arrives through jsonargparse as the string 'None' and is read as
    null (tests/test_dmd2.py's progressive test runs that flag)."""
    build_model("wan_t2v").save_pretrained(tmp_path / "wan")
    experts = {"teacher": Expert(arch="wan_t2v"),
               "transformer": Expert(arch="wan_t2v", pretrained=str(tmp_path / "wan"), init_from="teacher")}
    with pytest.raises(ValueError, match=r"'transformer': both pretrained=.* and init_from='teacher'.*"
                                         r"experts\.transformer\.init_from null"):
        ModelCard(experts=experts)
    assert Expert(arch="wan_t2v", init_from="None").init_from is None
    assert Expert(arch="wan_t2v", pretrained="null").pretrained is None


def test_nan_loss_skips_the_step_then_stops(tmp_path):
    """From iteration 3 the transformer's loss is NaN: its step is skipped (weights stay those after
    iteration 2, finite), the critic keeps training, and the run stops after max_nan_steps=2 in a row."""
    card = wan_card(extra={"critic": Expert(arch="wan_t2v", preset=TINY_WAN, trainable=True, optimizer=adamw())})
    module = TwoExperts(card, nan_at=3, max_nan_steps=2)
    snapshots = {}

    class Snapshot(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            snapshots[trainer.global_step] = {k: v.clone() for k, v in card["transformer"].state_dict().items()}

    trainer = quick_trainer(max_steps=10, callbacks=[Snapshot()])
    with pytest.raises(NonFiniteLossError, match=r"not finite for 2 iterations in a row \(run.max_nan_steps=2\)"), \
            pytest.warns(UserWarning, match=r"loss of \['transformer'\] is nan; step skipped"):
        trainer.fit(module, SyntheticVideos(num_samples=32, batch_size=2))
    final = card["transformer"].state_dict()
    assert all(torch.isfinite(v).all() for v in final.values())
    assert all(torch.equal(v, final[k]) for k, v in snapshots[2].items())
    # iteration 3: the transformer skipped, the critic stepped; iteration 4 stopped at the transformer
    assert card.versions["transformer"] == 2 and card.versions["critic"] == 3


def test_empty_dataset_and_tiny_dataset():
    with pytest.raises(ValueError, match="num_samples=0"):
        SyntheticVideos(num_samples=0).train_dataset()
    module = Finetune(wan_card())
    with pytest.raises(ValueError, match=r"fewer than batch_size=4"):
        quick_trainer(max_steps=1).fit(module, SyntheticVideos(num_samples=2, batch_size=4))


@pytest.mark.slow
def test_two_experts_under_ddp(tmp_path):
    """Two processes: plain `ddp` with two plain experts stops with the fix named; with
    `ddp_find_unused_parameters_true` both experts train and count iterations."""
    import subprocess

    import yaml

    def run(strategy: str) -> subprocess.CompletedProcess:
        experts = {"text_encoder": {"arch": "umt5"}, "vae": {"arch": "wan_vae"}}
        for name in ("transformer", "critic"):
            experts[name] = {"arch": "wan_t2v", "preset": TINY_WAN, "trainable": True,
                             "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3}}}
        config = {
            "seed_everything": 0,
            "trainer": {"max_steps": 2, "accelerator": "cpu", "devices": 2, "strategy": strategy, "logger": False,
                        "enable_progress_bar": False, "default_root_dir": str(tmp_path / strategy),
                        "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                       "init_args": {"dirpath": str(tmp_path / strategy), "save_last": True}}]},
            "model": {"class_path": "tests.helpers.TwoExperts",
                      "init_args": {"card": {"experts": experts, "text_max_length": 32}}},
            "data": {"class_path": "posttrain.datamodules.synthetic.SyntheticVideos",
                     "init_args": {"num_samples": 8, "batch_size": 2, "frames": 5, "height": 16, "width": 16}},
        }
        path = tmp_path / f"{strategy}.yaml"
        path.write_text(yaml.safe_dump(config))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
        return launch.posttrain("fit", "--config", str(path), cwd=ROOT, env=env, timeout=300)

    refused = run("ddp")
    assert refused.returncode != 0
    assert "find_unused_parameters: set `trainer.strategy: ddp_find_unused_parameters_true`" in refused.stderr
    done = run("ddp_find_unused_parameters_true")
    assert done.returncode == 0, done.stderr[-3000:]
    from posttrain.modules.io.checkpoints import load

    state = load(str(tmp_path / "ddp_find_unused_parameters_true" / "last.ckpt"))
    assert state["global_step"] == 2
    assert state["posttrain_versions"]["transformer"] == 2 and state["posttrain_versions"]["critic"] == 2
