"""One batch schema every datamodule fills (modules/io/batch.py), read one way; the console's metric keys."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from posttrain.callbacks.progress import IterationProgressBar
from posttrain.datamodules.prompts import Prompts
from posttrain.datamodules.synthetic import ShapesDataset, SyntheticVideos
from posttrain.modules.io import batch as batch_schema


def loaders():
    prompts = Prompts(prompts=["a red circle", "a cat", "x"], batch_size=2)
    videos = SyntheticVideos(num_samples=4, val_samples=2, frames=1, height=8, width=8, batch_size=2)
    prompts.setup("fit")
    videos.setup("fit")
    return {"prompts/train": prompts.train_dataloader(), "prompts/val": prompts.val_dataloader(),
            "prompts/predict": prompts.predict_dataloader(), "videos/train": videos.train_dataloader(),
            "videos/val": videos.val_dataloader(), "videos/predict": videos.predict_dataloader()}


@pytest.mark.parametrize("name", ["prompts/train", "prompts/val", "prompts/predict", "videos/train",
                                  "videos/val", "videos/predict"])
def test_every_loader_fills_the_schema(name):
    """Every batch holds its prompts, each item's dataset index and its group key, read by one reader each."""
    batch = next(iter(loaders()[name]))
    assert {"prompt", "index", "group"} <= set(batch), sorted(batch)
    prompts = batch_schema.prompts(batch, "test")
    assert prompts and all(isinstance(p, str) for p in prompts)
    assert batch["index"].dtype == torch.long and batch["index"].shape == (len(prompts),)
    assert torch.equal(batch_schema.group_ids(batch, 3), batch["group"].repeat_interleave(3))
    assert batch_schema.seed(batch, default=-1) == int(batch["index"][0])


@pytest.mark.parametrize("device, pinned", [("cpu", False), ("cuda", True)])
def test_training_batches_are_pinned_when_the_run_trains_on_a_gpu(device, pinned):
    """Page-locked batches on a GPU run (Lightning's copy to the device is then non-blocking); none on a CPU run,
    where pinning has nothing to overlap with."""
    videos = SyntheticVideos(num_samples=4, val_samples=2, frames=1, height=8, width=8, batch_size=2)
    strategy = SimpleNamespace(root_device=torch.device(device), distributed_sampler_kwargs=None)
    videos.trainer = SimpleNamespace(strategy=strategy)
    videos.setup("fit")
    assert videos.train_dataloader().pin_memory is pinned


def test_readers_name_the_method_and_fall_back():
    with pytest.raises(ValueError, match="flow_grpo: the batch holds no prompts"):
        batch_schema.prompts({"prompt": []}, "flow_grpo")
    assert batch_schema.seed({"prompt": ["a"]}, default=7) == 7
    assert batch_schema.item("a", 3, image=1) == {"prompt": "a", "index": 3, "group": 3, "image": 1}


def test_progress_bar_shows_each_experts_loss_the_reward_and_learning_rates():
    metrics = {"train/loss/transformer": torch.tensor(0.5), "train/loss/refiner_0": torch.tensor(2.0),
               "train/lr/transformer": torch.tensor(1e-4), "train/reward": torch.tensor(0.25),
               "train/kl/transformer": torch.tensor(3.0), "val/reward": torch.tensor(0.5)}
    shown = IterationProgressBar().get_metrics(SimpleNamespace(callback_metrics=metrics), None)
    assert shown == {"loss/transformer": "0.5", "loss/refiner_0": "2", "lr/transformer": "1.00e-04",
                     "reward": "0.25", "val/reward": "0.5"}


def test_captions_without_clips_are_the_clips_captions():
    """``ShapesDataset.captions`` (what ``Prompts`` and ``SyntheticVideos.prompt_list`` read) equals the captions of
    the rendered samples, filters and concept mixing included; a method on prompts and one on the clips of the same
    seed train on the same captions."""
    for kwargs in [dict(seed=0), dict(seed=5, exclude=["magenta"]), dict(seed=1, concept=["magenta"],
                                                                       concept_fraction=0.5)]:
        shapes = ShapesDataset(40, 1, 8, 8, **kwargs)
        assert shapes.captions() == [shapes[i]["prompt"] for i in range(40)]
    clips = SyntheticVideos(num_samples=24, seed=3)
    assert clips.prompt_list() == Prompts(num_synthetic=24, seed=3).prompt_list()
    assert clips.prompt_list() == [clips.train_dataset()[i]["prompt"] for i in range(24)]
