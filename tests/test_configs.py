"""Every YAML in configs/ (and the tests' own in tests/configs/) parses with the real CLI, builds its card and names
real classes."""
from __future__ import annotations

import glob
import os

import pytest
import torch
from lightning.pytorch import LightningModule

from posttrain.lit.base import ExpertModule
from posttrain.lit.tools.config import PosttrainCLI

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))) + \
    sorted(glob.glob(os.path.join(ROOT, "tests", "configs", "*.yaml")))


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p) for p in CONFIGS])
def test_config_parses_and_builds(path, tmp_path):
    extra = ["--data.init_args.root", str(tmp_path)] if "folder" in os.path.basename(path) else []
    cli = PosttrainCLI(args=["--config", path, *extra], run=False)
    assert isinstance(cli.model, ExpertModule)
    cli.model.configure_model()
    card = cli.model.card
    if not hasattr(cli.model, "training_step") or type(cli.model).training_step is LightningModule.training_step:
        # a serving-only config (a workflow for `posttrain predict`): it writes media, trains nothing
        assert any(type(c).__name__ == "MediaWriter" for c in cli.trainer.callbacks), f"{path}: no MediaWriter"
        return
    assert card.trainable, f"{path}: no trainable expert"
    for name in card.trainable:  # every trainable expert has real parameters and an optimizer
        assert card.parameters_of(name), f"{path}: {name} has no trainable parameters"
    loggers = cli.trainer.loggers
    assert any(type(logger).__name__ == "WandbLogger" for logger in loggers), f"{path}: no WandbLogger"
    checkpoints = [c for c in cli.trainer.callbacks if type(c).__name__ == "ModelCheckpoint"]
    assert checkpoints and all(c.dirpath for c in checkpoints), f"{path}: ModelCheckpoint.dirpath must be pinned"


def test_finetune_config_is_the_embedded_default():
    cli = PosttrainCLI(args=["--config", os.path.join(ROOT, "configs", "finetune.yaml")], run=False)
    assert type(cli.model).__name__ == "Finetune"
    assert type(cli.datamodule).__name__ == "SyntheticVideos"
    assert all(spec.pretrained is None for spec in cli.model.card.specs.values())  # nothing to download


@pytest.mark.slow
@pytest.mark.parametrize("config", ["finetune.yaml", "dmd2.yaml"])  # no `run:` in the YAML, and one with a `run:`
def test_seed_everything_reseeds_the_methods_own_noise(config, tmp_path):
    """The method draws its noise from its own generators (``run.seed``); a run's ``seed_everything`` reaches them
    unless the config gives ``run.seed`` itself."""
    def first_draw(*extra: str) -> tuple[int, torch.Tensor]:
        cli = PosttrainCLI(args=["--config", os.path.join(ROOT, "configs", config), "--trainer.logger", "false",
                                 "--trainer.default_root_dir", str(tmp_path), *extra], run=False)
        return cli.model.run.seed, torch.randn(4, generator=cli.model.generator)

    seed, one = first_draw("--seed_everything", "1")
    assert seed == 1
    assert torch.equal(one, first_draw("--seed_everything", "1")[1])
    assert not torch.equal(one, first_draw("--seed_everything", "2")[1])
    assert first_draw("--seed_everything", "2", "--model.init_args.run.seed", "1")[0] == 1  # given: it wins
    assert first_draw()[0] == 0  # the configs' seed_everything: 0
