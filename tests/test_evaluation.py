"""The Evaluate callback: what it logs comes from the samples it pairs with the prompts it names."""
from __future__ import annotations

import glob
import json
import re

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer

from posttrain.callbacks.evaluation import Evaluate, still_caption
from posttrain.datamodules.synthetic import ShapesDataset
from posttrain.lit.tools.cli import main
from posttrain.modules.models.generators import VideoSize
from posttrain.modules.world.world import parse_caption


class Oracle(LightningModule):
    """A generator that draws exactly what it is asked (the rendered data of the same caption), or, with
    ``rotate``, what the next prompt of the batch asks: the callback must score the first perfectly."""

    def __init__(self, rotate: bool = False):
        super().__init__()
        self.video = VideoSize(5, 32, 32)
        self.rotate = rotate
        self.layer = torch.nn.Linear(1, 1)
        self.lookup = {}

    def generate(self, prompts, seed=0):
        videos = torch.stack([self.lookup[p] for p in prompts])
        return videos.roll(1, 0) if self.rotate else videos

    def validation_step(self, batch, batch_idx):
        return None

    def val_dataloader(self):
        return torch.utils.data.DataLoader([0])


def validate(module, callback, tmp_path):
    data = ShapesDataset(callback.num_prompts, 5, 32, 32, seed=callback.seed)
    module.lookup = {data[i]["prompt"]: data[i]["video"] for i in range(len(data))}
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path), callbacks=[callback])
    return trainer.validate(module, verbose=False)[0]


def test_oracle_samples_score_perfect_and_mismatched_ones_do_not(tmp_path):
    make = lambda: Evaluate(metrics=["geneval", "frechet"], num_prompts=16, batch_size=4, table=False)
    right = validate(Oracle(), make(), tmp_path)
    wrong = validate(Oracle(rotate=True), make(), tmp_path)
    for fact in ("shape", "colour", "background", "motion", "all"):
        assert right[f"val/geneval/{fact}"] >= 0.95, right
    assert wrong["val/geneval/all"] <= 0.2, wrong
    # the same frames in another order: same feature statistics, so the Fréchet distance cannot tell
    # (it compares sets), while GenEval (which pairs each sample with its prompt) can
    assert right["val/geneval/frechet"] == pytest.approx(0.0, abs=1e-2)
    assert wrong["val/geneval/frechet"] == pytest.approx(0.0, abs=1e-2)


def test_a_still_generator_is_asked_without_motion():
    assert still_caption("a red circle moving left on a blue background") == "a red circle on a blue background"
    assert parse_caption(still_caption("a red circle moving left on a blue background")).motion is None


def test_bad_arguments_fail_at_start_up():
    with pytest.raises(ValueError, match="choose from"):
        Evaluate(metrics=["fid"])
    with pytest.raises(ValueError, match="must be >= 1"):
        Evaluate(num_prompts=0)
    with pytest.raises(ValueError, match="include"):
        Evaluate(include=["colour:mauve"])


@pytest.mark.slow
def test_validate_of_the_default_finetune_logs_geneval_per_fact_and_a_wandb_table(tmp_path, capsys):
    extra = tmp_path / "evaluate.yaml"
    extra.write_text("trainer:\n  callbacks+:\n    - class_path: Evaluate\n"
                     "      init_args: {name: magenta, include: [magenta], num_prompts: 4, batch_size: 2}\n")
    main(["validate", "--config", "configs/finetune.yaml", "--config", str(extra),
          "--trainer.default_root_dir", str(tmp_path), "--data.init_args.val_samples", "2"])
    media = tmp_path / "wandb" / "offline-run-*" / "files" / "media"
    tables = glob.glob(str(media / "table" / "val" / "magenta" / "*.table.json"))
    assert len(tables) == 1
    table = json.loads(open(tables[0]).read())
    assert table["columns"] == ["prompt", "sample", "shape", "colour", "background", "motion"]
    assert len(table["data"]) == 4 and all("magenta" in row[0] for row in table["data"])
    printed = capsys.readouterr().out  # validate's results table
    for fact in ("shape", "colour", "background", "motion", "all"):
        value = re.search(rf"val/magenta/{fact}\s*[│|]\s*([0-9.]+)", printed)
        assert value is not None and 0.0 <= float(value.group(1)) <= 1.0, printed


def test_two_evaluations_of_one_name_are_refused(tmp_path):
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path), callbacks=[Evaluate(num_prompts=2), Evaluate(num_prompts=4)])
    with pytest.raises(ValueError, match="two Evaluate callbacks are named 'geneval'"):
        trainer.validate(Oracle(), verbose=False)


def test_clip_score_is_logged_from_a_local_folder_and_a_missing_one_stops_at_start_up(tmp_path):
    from helpers import tiny_clip_folder

    with pytest.raises(ValueError, match="clip_score needs `clip:`"):
        Evaluate(metrics=["clip_score"])
    with pytest.raises(FileNotFoundError, match="not a local folder"):
        Evaluate(metrics=["clip_score"], clip=str(tmp_path / "missing"))
    folder = tiny_clip_folder(str(tmp_path / "clip"))
    logged = validate(Oracle(), Evaluate(metrics=["geneval", "clip_score"], clip=folder, num_prompts=4,
                                         batch_size=2, table=False), tmp_path)
    assert 0.0 <= logged["val/geneval/clip_score"] <= 100.0 and logged["val/geneval/all"] >= 0.95


@pytest.mark.parametrize("card", ["wan", "flux"])
def test_evaluation_samples_are_the_served_ones_for_any_family(card):
    """``modules.evaluation.generate`` on plain modules (an ``arch`` and its text encoders in the adapter's order)
    gives exactly what the method serves from the same seed (``Finetune.generate``), for Wan and for FLUX."""
    from posttrain.lit.base import RunArgs
    from posttrain.lit.finetune import Finetune
    from posttrain.modules.eval.evaluation import generate
    from posttrain.modules.flow.samplers import FlowMatchSampler
    from tests.conftest import flux_card, wan_card

    size = RunArgs(frames=1, height=16, width=16) if card == "flux" else RunArgs(frames=5, height=16, width=16)
    module = Finetune((flux_card if card == "flux" else wan_card)(), run=size,
                      sampler=FlowMatchSampler(num_steps=4, guidance_scale=3.0))
    module.configure_model()
    prompts = ["a red circle moving left on a blue background", "a yellow square on a green background"]
    served = module.generate(prompts, seed=3)
    stage = module.stage
    encoders = [stage.card[name] for name in stage.encoders]
    tokenizers = [stage.card.tokenizers[name] for name in stage.encoders]
    ours = generate(stage.card[stage.transformer], encoders, tokenizers, stage.card[stage.vae], prompts, seed=3,
                    frames=size.frames, height=size.height, width=size.width, sampler=module.sampler,
                    text_max_length=stage.card.text_max_length, arch=stage.arch)
    assert torch.equal(ours, served)
