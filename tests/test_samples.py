"""SampleVideos: the run's own prompts (given, a file, the data's validation captions, the world's two as the last
resort), one generation per cadence, shares of the prompts over data-parallel ranks, lighter sampling settings.
Two processes sharing the prompts run in tests/test_strategy.py (`test_sample_videos_under_ddp_and_zero3`)."""
from __future__ import annotations

import logging
import os

import pytest
import torch
from lightning.pytorch import LightningDataModule

from posttrain.callbacks.samples import DEFAULT_PROMPTS, SampleVideos, prompt_shares
from posttrain.datamodules import Prompts, Requests, SyntheticVideos, VideoFolder
from posttrain.lit.base import RunArgs
from posttrain.lit.finetune import Finetune
from posttrain.modules.flow.samplers import FlowMatchSampler
from posttrain.modules.io.media import gif_bytes, slug
from tests.conftest import wan_card
from tests.helpers import quick_trainer
from tests.test_folder_data import caption, clip


def val_prompts(dm) -> list[str]:
    return [p for batch in dm.val_dataloader() for p in batch["prompt"]]


def test_prompt_shares_are_contiguous_balanced_and_padded_to_one_size():
    """3 prompts over 2 ranks: sizes 2 and 1, the second padded with its own last prompt; 2 prompts over 4 ranks: the
    two empty shares repeat the list's last. Over any split the real indices, in rank order, are every prompt once."""
    assert prompt_shares(4, 1) == [([0, 1, 2, 3], 4)]
    assert prompt_shares(3, 2) == [([0, 1], 2), ([2, 2], 1)]
    assert prompt_shares(4, 3) == [([0, 1], 2), ([2, 2], 1), ([3, 3], 1)]
    assert prompt_shares(2, 4) == [([0], 1), ([1], 1), ([1], 0), ([1], 0)]
    for count in range(1, 9):
        for parts in range(1, 6):
            shares = prompt_shares(count, parts)
            assert len({len(indices) for indices, _ in shares}) == 1  # every rank generates as many
            assert [i for indices, real in shares for i in indices[:real]] == list(range(count))


def test_prompts_are_given_read_from_a_file_or_taken_from_the_data(tmp_path):
    synthetic = SyntheticVideos(num_samples=16, batch_size=2)
    assert SampleVideos(prompts=["a cat", " "]).resolve_prompts(synthetic) == (["a cat"], "given")
    path = tmp_path / "prompts.txt"
    path.write_text("a fox in the snow\n\nwaves at dusk\n")
    assert SampleVideos(prompts_file=str(path)).resolve_prompts(synthetic) == (
        ["a fox in the snow", "waves at dusk"], f"from {path}")
    # the data's validation split: its first num_prompts prompts, whatever the module
    assert synthetic.sample_prompts(3) == val_prompts(synthetic)[:3]
    assert SampleVideos(num_prompts=3).resolve_prompts(synthetic) == (val_prompts(synthetic)[:3],
                                                                     "from the data (SyntheticVideos)")
    prompts = Prompts(num_synthetic=6, batch_size=2)
    assert SampleVideos().resolve_prompts(prompts)[0] == val_prompts(prompts)[:4]
    requests = Requests(num_requests=4, val_requests=3)  # the base class reads the validation loader
    assert SampleVideos().resolve_prompts(requests)[0] == val_prompts(requests)  # 3: all the split has
    # no data, or data without a validation split: the world's two prompts
    assert SampleVideos().resolve_prompts(None) == (list(DEFAULT_PROMPTS), "of the synthetic world (the data offers "
                                                                             "none)")
    assert SampleVideos().resolve_prompts(LightningDataModule())[0] == list(DEFAULT_PROMPTS)


def test_a_folder_offers_its_held_out_captions_else_its_training_captions(tmp_path):
    for name, text in [("a.gif", "a red circle"), ("b.gif", "a second clip"), ("c.gif", "the third")]:
        caption(clip(tmp_path / name, frames=5, height=8, width=8), text)
    held_out = VideoFolder(str(tmp_path), frames=5, height=8, width=8, val_files=["c.gif"], batch_size=1)
    held_out.setup("fit")
    assert held_out.sample_prompts(4) == ["the third"] == val_prompts(held_out)
    no_split = VideoFolder(str(tmp_path), frames=5, height=8, width=8, batch_size=1)
    assert no_split.sample_prompts(2) == ["a red circle", "a second clip"]  # scanned on demand, as predict does


def test_precomputed_rows_offer_their_validation_prompts(tmp_path):
    """``posttrain preprocess`` of the synthetic data keeps its prompts: the rows offer the validation captions the
    videos had."""
    import yaml

    from posttrain.datamodules import PrecomputedVideos
    from posttrain.lit.tools.preprocess import preprocess

    config = yaml.safe_load(open(os.path.join(os.path.dirname(__file__), "..", "configs", "finetune.yaml")))
    config["data"]["init_args"].update(num_samples=4, val_samples=3, batch_size=2)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    preprocess(str(tmp_path / "config.yaml"), str(tmp_path / "rows"))
    videos = SyntheticVideos(**config["data"]["init_args"])
    assert PrecomputedVideos(str(tmp_path / "rows")).sample_prompts(2) == videos.sample_prompts(2)


def test_bad_settings_are_named_at_start_up(tmp_path):
    with pytest.raises(ValueError, match=r"give `prompts` or `prompts_file`, not both; num_prompts=0 must be >= 1"):
        SampleVideos(prompts=["a cat"], prompts_file="p.txt", num_prompts=0)
    with pytest.raises(ValueError, match=r"`prompts` is empty"):
        SampleVideos(prompts=[])
    with pytest.raises(FileNotFoundError, match=r"missing\.txt"):
        SampleVideos(prompts_file=str(tmp_path / "missing.txt"))
    module = Finetune(wan_card(), sampler=FlowMatchSampler(num_steps=2, step_sigmas=[1.0, 0.5]),
                      run=RunArgs(frames=5, height=32, width=32))
    module.configure_model()
    with pytest.raises(ValueError, match=r"num_steps=3, but the method samples a few-step list .*drop num_steps; "
                                         r"frames=6: video size: frames=6 must be 4k\+1"):
        SampleVideos(num_steps=3, frames=6)._check_settings(module)


class Recorded(Finetune):
    """Finetune that records, at each ``generate``, the iteration, prompts, seed, steps and the videos' frames."""

    calls: list

    def generate(self, prompts, seed=0, **kwargs):
        videos = super().generate(prompts, seed=seed, **kwargs)
        iteration = self.trainer.fit_loop.epoch_loop.batch_progress.total.processed
        self.calls.append((iteration, list(prompts), seed, self.sampler.num_steps, videos.shape[2]))
        return videos


@pytest.mark.parametrize("max_steps, sampled", [(4, [2, 4]), (5, [2, 4, 5])])
def test_one_generation_per_cadence_and_the_data_prompts(tmp_path, caplog, max_steps, sampled):
    """Every 2 iterations: with max_steps a multiple of 2 the end of training adds no generation (4 -> 2 calls), and
    otherwise the end samples once more (5 -> 3). The prompts are the data's first 3 validation captions, in one
    call (one process), with the callback's lighter steps and frames, the method's own restored after."""
    module = Recorded(wan_card(), sampler=FlowMatchSampler(num_steps=20), run=RunArgs(frames=5, height=32, width=32))
    module.calls = []
    data = SyntheticVideos(num_samples=8, batch_size=2, frames=5, height=32, width=32)
    samples = SampleVideos(every_n_iterations=2, num_prompts=3, num_steps=2, frames=9)
    trainer = quick_trainer(max_steps=max_steps, callbacks=[samples], default_root_dir=str(tmp_path))
    with caplog.at_level(logging.INFO):
        trainer.fit(module, data)
    wanted = val_prompts(data)[:3]
    assert [c[0] for c in module.calls] == sampled
    assert all(c[1:] == (wanted, 0, 2, 9) for c in module.calls), module.calls  # prompts, seed, steps, frames
    assert module.sampler.num_steps == 20 and module.run.frames == 5
    files = sorted(os.listdir(tmp_path / "samples"))
    assert files == sorted(f"it{it:06d}_{i}_{slug(p)}.gif" for it in sampled for i, p in enumerate(wanted))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("SampleVideos:")]
    assert said == [f"SampleVideos: every 2 iterations, num_steps=2, frames=9, 3 prompts from the data "
                    f"(SyntheticVideos): {', '.join(map(repr, wanted))}"], said


def test_one_process_draws_the_samples_it_always_drew(tmp_path):
    """On one process the prompts are one call seeded with ``seed``, as before shares existed: each written GIF is
    byte for byte the one of the module's own ``generate`` of the same prompts and seed."""
    module = Finetune(wan_card(), sampler=FlowMatchSampler(num_steps=2), run=RunArgs(frames=5, height=32, width=32))
    samples = SampleVideos(every_n_iterations=1, prompts=list(DEFAULT_PROMPTS), seed=3)
    quick_trainer(max_steps=1, callbacks=[samples], default_root_dir=str(tmp_path)).fit(
        module, SyntheticVideos(num_samples=4, batch_size=2, frames=5, height=32, width=32))
    module.eval()
    expected = module.generate(list(DEFAULT_PROMPTS), seed=3)
    for i, prompt in enumerate(DEFAULT_PROMPTS):
        written = (tmp_path / "samples" / f"it000001_{i}_{slug(prompt)}.gif").read_bytes()
        assert written == gif_bytes(expected[i]).getvalue()


def test_an_image_to_video_generator_samples_the_validation_clips_from_their_first_frames(tmp_path, caplog):
    """Wan I2V: the samples are the first 3 validation clips, each from its caption and its own first frame, byte for
    byte the module's ``generate`` of them; prompts given without frames are refused at the start, naming why."""
    from tests.conftest import i2v_card

    module = Finetune(i2v_card(), sampler=FlowMatchSampler(num_steps=2), run=RunArgs(frames=5, height=16, width=16))
    data = SyntheticVideos(num_samples=4, batch_size=2, frames=5, height=16, width=16)
    samples = SampleVideos(every_n_iterations=1, num_prompts=3, seed=3)
    with caplog.at_level(logging.INFO):
        quick_trainer(max_steps=1, callbacks=[samples], default_root_dir=str(tmp_path)).fit(module, data)
    rows = [row for batch in data.val_dataloader() for row in zip(batch["prompt"], batch["video"][:, :, 0])][:3]
    wanted, images = [p for p, _ in rows], torch.stack([image for _, image in rows])
    assert any(r.getMessage().startswith("SampleVideos: every 1 iterations, 3 prompts with their first frames")
               for r in caplog.records)
    module.eval()
    expected = module.generate(wanted, seed=3, images=images)
    for i, prompt in enumerate(wanted):
        written = (tmp_path / "samples" / f"it000001_{i}_{slug(prompt)}.gif").read_bytes()
        assert written == gif_bytes(expected[i]).getvalue()
    given = SampleVideos(prompts=list(DEFAULT_PROMPTS))
    with pytest.raises(ValueError, match=r"SampleVideos: the generator \('transformer'\) generates from a first "
                                         r"frame, and prompts give none: drop it to sample the data's validation clips"):
        quick_trainer(max_steps=1, callbacks=[given], default_root_dir=str(tmp_path / "given")).fit(module, data)
    (tmp_path / "clips").mkdir()
    caption(clip(tmp_path / "clips" / "a.mp4", frames=5, height=16, width=16, colour="red"), "a red circle")
    no_split = VideoFolder(str(tmp_path / "clips"), frames=5, height=16, width=16)
    with pytest.raises(ValueError, match=r"the data \(VideoFolder\) has no validation clips to take them from: give "
                                         r"it a validation split \(VideoFolder: val_fraction or val_files\)"):
        SampleVideos().validation_rows(no_split, module)


@pytest.mark.slow
def test_a_sequence_parallel_group_samples_one_share_together(tmp_path):
    """SP = 2 over 2 processes is one data-parallel rank: both processes of the group generate the same 3 prompts
    (a group shares each sample's tokens), and rank 0 writes the samples one process writes, to GIF rounding."""
    import numpy as np
    from PIL import Image, ImageSequence

    import helpers_strategy as h

    samples = [{"class_path": "posttrain.callbacks.samples.SampleVideos",
                "init_args": {"every_n_iterations": 1, "num_prompts": 3, "num_steps": 2}}]
    folders = {}
    for devices in (1, 2):
        folder = str(tmp_path / f"sp{devices}")
        done = h.fit(h.config(folder, zero_stage=None, max_steps=1, devices=devices, sharding_strategy=True,
                              sequence_parallel=devices, callbacks=samples))
        assert done.returncode == 0, done.stderr[-5000:]
        folders[devices] = os.path.join(folder, "samples")
    names = sorted(os.listdir(folders[1]))
    assert len(names) == 3 and sorted(os.listdir(folders[2])) == names

    def frames(path):
        with Image.open(path) as gif:
            return np.stack([np.asarray(f.convert("RGB"), dtype=np.float32) for f in ImageSequence.Iterator(gif)])

    for name in names:
        one, shared = frames(os.path.join(folders[1], name)), frames(os.path.join(folders[2], name))
        assert np.abs(one - shared).mean() < 1.0, name  # another prompt's tokens in the group would differ by tens
