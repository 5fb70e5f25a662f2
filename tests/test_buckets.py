"""VideoFolder on data as it comes: aspect-ratio and frame-count buckets, files skipped and named once, frame windows
and frame rates, several datasets with repeats, a split that keeps training data, a bucket order that every rank
agrees on and that resumes bitwise, a latents cache filled in shares and resumable."""
from __future__ import annotations

import collections
import logging
import os
import warnings

import imageio.v2 as imageio
import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from PIL import Image
from torch.utils.data import DistributedSampler

import posttrain.datamodules.folder as folder
from posttrain.datamodules.folder import (FolderSet, VideoFolder, default_frame_buckets, nearest_size,
                                          resolution_buckets)
from posttrain.callbacks.checkpoints import ModelCheckpoint
from posttrain.datamodules.sampling import BucketSampler
from posttrain.lit.base import RunArgs
from posttrain.lit.finetune import Finetune
from posttrain.modules.models.presets import build_model
from tests.conftest import wan_card
from tests.test_folder_data import caption, clip, image

SHAPES = {"square": (32, 32), "tall": (48, 16), "wide": (16, 48)}  # (height, width) of the source clips
LENGTHS = (3, 5, 9, 12)  # 3 frames: shorter than the shortest frame bucket of a clip (5)
BUCKETED = dict(frames=9, height=32, width=32, buckets=True, bucket_stride=8)
# The mixed folder holds files the data must skip: the test of that asserts its one warning; here it is expected.
pytestmark = pytest.mark.filterwarnings("ignore:VideoFolder. skipped 4 of:UserWarning")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """3 aspect ratios x 4 lengths (mp4 and gif), a corrupt mp4 and two images: 15 files, 11 usable."""
    root = tmp_path_factory.mktemp("mixed")
    for name, (h, w) in SHAPES.items():
        for n in LENGTHS:
            ext = ".gif" if n in (5, 12) else ".mp4"
            caption(clip(root / f"{name}_{n}{ext}", frames=n, height=h, width=w), f"{name} clip of {n} frames")
    (root / "broken.mp4").write_bytes(b"\x00\x01 not really a video" * 10)
    caption(root / "broken.mp4", "broken")
    caption(image(root / "img_wide.png", (255, 0, 0), size=(40, 20)), "a wide image")
    caption(image(root / "img_square.jpg", (0, 0, 255), size=(32, 32)), "a square image")
    return str(root)


def loaded(root=None, **options) -> VideoFolder:
    dm = VideoFolder(root, **options)
    dm.setup("fit")
    return dm


def epoch_batches(loader, epoch=None, n=None) -> list[dict]:
    if epoch is not None:
        loader.sampler.set_epoch(epoch)
    out = []
    for batch in loader:
        out.append(batch)
        if n is not None and len(out) == n:
            break
    return out


# ---------------------------------------------------------------------- the tables
def test_resolution_and_frame_buckets():
    """Sizes of ~32² pixels in steps of 8 (musubi-tuner's rule: short side √A/2 … √A, long side A/short floored
    to the step), the configured size itself among the 480x832 ones, 4k+1 frame counts up to frames."""
    assert resolution_buckets(32 * 32, 8) == [(16, 64), (24, 40), (32, 32), (40, 24), (64, 16)]
    wan = resolution_buckets(480 * 832, 16)
    assert (480, 832) in wan and (832, 480) in wan and all(h % 16 == 0 and w % 16 == 0 for h, w in wan)
    assert all(h * w <= 480 * 832 for h, w in wan)
    assert default_frame_buckets(1) == [1] and default_frame_buckets(9) == [1, 5, 9]
    assert default_frame_buckets(81) == [1, 5, 9, 17, 33, 65, 81] and default_frame_buckets(13) == [1, 5, 9, 13]
    sizes = tuple(resolution_buckets(32 * 32, 8))
    assert nearest_size(sizes, 1920, 1080) == (40, 24)  # a vertical phone clip takes a vertical bucket
    assert nearest_size(sizes, 1080, 1920) == (24, 40) and nearest_size(sizes, 100, 100) == (32, 32)


# ---------------------------------------------------------------------- a folder as it comes
def test_mixed_folder_skips_once_buckets_and_draws_every_item_once_per_epoch(mixed, caplog):
    with warnings.catch_warnings(record=True) as warned, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        dm = loaded(mixed, batch_size=2, **BUCKETED)
        loader = dm.train_dataloader()
    said = [str(w.message) for w in warned if "VideoFolder: skipped" in str(w.message)]
    assert len(said) == 1, said  # one warning: how many, why, the paths
    assert "skipped 4 of 15 files (too short: 3, unreadable: 1)" in said[0]
    for name in ("broken.mp4", "square_3.mp4", "tall_3.mp4", "wide_3.mp4"):
        assert said[0].count(name) == 1 + (name == "broken.mp4"), name  # broken.mp4 is also in ffmpeg's fix
    assert "has 3 frames; the shortest frame bucket, 5, with frame_stride=1 needs 5" in said[0]
    assert sorted(os.path.basename(p) for p, _ in dm.skipped) == ["broken.mp4", "square_3.mp4", "tall_3.mp4",
                                                                   "wide_3.mp4"]
    # the bucket table, said at start: the tall clips keep their frame in a 64x16 bucket, the images take 1 frame
    assert dm.bucket_table() == [((1, 24, 40), 1, 1), ((1, 32, 32), 1, 1), ((5, 16, 64), 1, 1), ((5, 32, 32), 1, 1),
                                 ((5, 64, 16), 1, 1), ((9, 16, 64), 2, 1), ((9, 32, 32), 2, 1), ((9, 64, 16), 2, 1)]
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("VideoFolder buckets")]
    assert len(logged) == 1 and "9 x   64 x 16         2 samples      1 batches" in logged[0], logged
    assert "VideoFolder: 11 train / 0 validation items" in caplog.text
    by_name = {os.path.basename(e.path): e.bucket for e in dm.train_entries}
    assert by_name["tall_12.gif"] == (9, 64, 16) and by_name["wide_5.gif"] == (5, 16, 64)
    assert by_name["img_wide.png"] == (1, 24, 40) and by_name["square_9.mp4"] == (9, 32, 32)

    dataset = dm.train_dataset()
    for epoch in range(2):
        seen = collections.Counter()
        for batch in epoch_batches(loader, epoch):
            buckets = {dataset.buckets()[i] for i in batch["index"].tolist()}
            assert len(buckets) == 1  # one bucket a batch, and the videos have its size
            assert batch["video"].shape[2:] == next(iter(buckets)) and 1 <= len(batch["prompt"]) <= 2
            seen.update(batch["index"].tolist())
        assert sorted(seen) == list(range(11)) and set(seen.values()) == {1}, (epoch, seen)


def test_several_datasets_repeats_prefixes_and_a_metadata_csv(mixed, tmp_path):
    """A folder, plus a metadata.csv set counted twice with a trigger word and its own frames: every item is drawn
    `repeats` times an epoch; the CSV's clip takes the set's 5 frames."""
    (tmp_path / "media").mkdir()
    clip(tmp_path / "media" / "long.gif", frames=12, height=16, width=16)
    image(tmp_path / "media" / "still.png", (0, 255, 0))
    (tmp_path / "subject.csv").write_text('file,caption,notes\nmedia/long.gif,"a clip, with a comma",x\n\n'
                                          'media/still.png,a still,y\n')
    dm = loaded(datasets=[FolderSet(root=mixed), {"metadata": str(tmp_path / "subject.csv"), "repeats": 2,
                                                  "caption_prefix": "ohwx, ", "frames": 5}], batch_size=3, **BUCKETED)
    dataset = dm.train_dataset()
    assert len(dataset) == 11 + 2 * 2
    own = {os.path.basename(e.path): (e.caption, e.bucket, e.repeats) for e in dm.train_entries if e.dataset == 1}
    assert own == {"long.gif": ("ohwx, a clip, with a comma", (5, 32, 32), 2),
                   "still.png": ("ohwx, a still", (1, 24, 40), 2)}
    seen = collections.Counter()
    for batch in epoch_batches(dm.train_dataloader(), 0):
        seen.update(dataset.entries[dataset.order[i]].path for i in batch["index"].tolist())
    assert seen == {e.path: e.repeats for e in dm.train_entries}  # items seen vs items present, repeats counted


def test_metadata_csv_errors_name_file_and_line(tmp_path):
    image(tmp_path / "a.png", (0, 0, 0))
    (tmp_path / "metadata.csv").write_text("path,text\na.png,x\n")
    with pytest.raises(ValueError, match=r"metadata\.csv:1: columns \['path', 'text'\] lack `file` or `caption`"):
        loaded(str(tmp_path), frames=1)
    (tmp_path / "metadata.csv").write_text("file,caption\na.png,ok\nmissing.png,x\n")
    with pytest.raises(FileNotFoundError, match=r"metadata\.csv:3: file 'missing\.png' does not exist"):
        loaded(str(tmp_path), frames=1)
    (tmp_path / "metadata.jsonl").write_text('{"file": "a.png", "caption": "x"}\n')
    with pytest.raises(ValueError, match=r"holds both metadata\.jsonl and metadata\.csv"):
        loaded(str(tmp_path), frames=1)


def test_strict_stops_at_the_first_file_and_images_need_a_one_frame_bucket(mixed, tmp_path):
    with pytest.raises(ValueError, match=r"broken\.mp4: cannot read this media file .*re-encode its source"):
        loaded(mixed, strict=True, **BUCKETED)
    # without buckets a 9-frame run takes no image (unless repeat_images): skipped and named as such
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        dm = loaded(mixed, frames=9, height=16, width=16)
    said = [str(w.message) for w in warned if "VideoFolder: skipped" in str(w.message)]
    assert len(said) == 1 and "(images in a clip run: 2, too short: 6, unreadable: 1)" in said[0], said
    assert "img_wide.png: an image is a 1-frame video but frames=9" in said[0]
    assert sorted(os.path.basename(p) for p, _ in dm.train_items) == ["square_12.gif", "square_9.mp4", "tall_12.gif",
                                                                      "tall_9.mp4", "wide_12.gif", "wide_9.mp4"]
    caption(clip(tmp_path / "short.gif", frames=3), "short")
    with pytest.raises(ValueError, match=r"no usable file: all 1 of .* were skipped \(too short: 1\):\n.*short\.gif: "
                                         r"has 3 frames; frames=9 with frame_stride=1 needs 9"):
        loaded(str(tmp_path), frames=9)


# ---------------------------------------------------------------------- frames: windows and frame rates
def grey_clip(path, levels, fps):
    """A clip whose frame i is a flat grey of ``levels[i]`` (read back: which source frame it is)."""
    frames = [np.full((16, 16, 3), v, np.uint8) for v in levels]
    if str(path).endswith(".gif"):
        Image.fromarray(frames[0]).save(path, save_all=True, append_images=[Image.fromarray(f) for f in frames[1:]],
                                        duration=int(1000 / fps), loop=0)
    else:
        imageio.mimwrite(str(path), frames, fps=fps, codec="libx264", macro_block_size=16)
    return path


def source_frames(video, step=20):
    """The source frame of each output frame of a grey clip (levels 0, step, 2·step, …)."""
    return ((video.mean((0, 2, 3)) + 1) * 127.5 / step).round().long().tolist()


def test_frame_windows_first_stride_uniform_and_random(tmp_path):
    caption(grey_clip(tmp_path / "g.gif", [20 * i for i in range(12)], fps=8), "grey")

    def frames_of(key=0, **options):
        dm = loaded(str(tmp_path), height=16, width=16, **options)
        return source_frames(dm.train_dataset().video(key))

    assert frames_of(frames=5) == [0, 1, 2, 3, 4]
    assert frames_of(frames=5, frame_stride=2) == [0, 2, 4, 6, 8]
    assert frames_of(frames=5, frame_window="uniform") == [0, 3, 6, 8, 11]  # linspace(0, 11, 5), rounded
    starts = set()
    for epoch in range(6):
        window = frames_of((0, epoch), frames=5, frame_stride=2, frame_window="random", seed=1)
        assert window == list(range(window[0], window[0] + 9, 2)) and 0 <= window[0] <= 3
        assert window == frames_of((0, epoch), frames=5, frame_stride=2, frame_window="random", seed=1)  # same key
        starts.add(window[0])
    assert len(starts) > 1  # the start moves with the epoch


def test_target_fps_resamples_from_the_containers_rate(tmp_path):
    """A 16 fps mp4 at target_fps=8 takes every 2nd source frame; at 12, the nearest of each 4/3 of a frame."""
    caption(grey_clip(tmp_path / "g.mp4", [15 * i for i in range(16)], fps=16), "grey")
    dm = loaded(str(tmp_path), frames=5, height=16, width=16, target_fps=8)
    assert source_frames(dm.train_dataset().video(0), step=15) == [0, 2, 4, 6, 8]
    dm = loaded(str(tmp_path), frames=5, height=16, width=16, target_fps=12)
    assert source_frames(dm.train_dataset().video(0), step=15) == [0, 1, 3, 4, 5]  # round(i * 4/3)
    with pytest.raises(ValueError, match=r"g\.mp4: has 16 frames; frames=9 at target_fps=4 needs 33 \(at its 16 fps\)"):
        loaded(str(tmp_path), frames=9, height=16, width=16, target_fps=4)


# ---------------------------------------------------------------------- the split
def test_validation_split_keeps_training_data_and_says_what_it_took(tmp_path, caplog):
    caption(image(tmp_path / "a.png", (0, 0, 0)), "a")
    with caplog.at_level(logging.INFO):
        dm = loaded(str(tmp_path), frames=1, val_fraction=0.5, batch_size=1)
    assert len(dm.train_items) == 1 and dm.val_dataloader() == []
    assert caplog.text.count("val_fraction=0.5 of one item would leave nothing to train on: no validation") == 1
    for name in "bc":
        caption(image(tmp_path / f"{name}.png", (0, 0, 0)), name)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        dm = loaded(str(tmp_path), frames=1, val_fraction=0.9, batch_size=1)
    assert len(dm.train_items) == 1 and len(dm.val_items) == 2  # round(0.9·3) = 3 would take them all
    assert caplog.text.count("VideoFolder: 1 train / 2 validation items") == 1


# ---------------------------------------------------------------------- the bucket order: resume, ranks
@pytest.mark.slow
@pytest.mark.parametrize("stop", [3, 8])
def test_bucket_order_resumes_bitwise_mid_epoch_and_at_its_end(mixed, stop):
    """8 bucket batches an epoch with random windows: the loader's state after ``stop`` batches, restored in a new
    datamodule, gives the uninterrupted run's remaining batches (videos bit for bit) and then its next epoch."""
    def loader():
        return loaded(mixed, batch_size=2, frame_window="random", seed=5, **BUCKETED).train_dataloader()

    straight = loader()
    order = epoch_batches(straight, 0) + epoch_batches(straight, 1)
    assert len(order) == 16
    first = loader()
    seen = epoch_batches(first, 0, n=stop)
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    epoch = resumed.sampler.epoch
    seen += epoch_batches(resumed)
    if epoch == 0:
        seen += epoch_batches(resumed, 1)
    assert epoch == (1 if stop == 8 else 0)
    assert len(seen) == len(order)
    for a, b in zip(seen, order):
        assert a["prompt"] == b["prompt"] and torch.equal(a["index"], b["index"])
        assert torch.equal(a["video"], b["video"])
    # the random windows are drawn per epoch: a 12-frame clip in a 9-frame bucket reads other frames in epoch 1
    videos = collections.defaultdict(list)
    for batch in order:
        for prompt, video in zip(batch["prompt"], batch["video"]):
            videos[prompt].append(video)
    assert any(not torch.equal(*videos[f"{name} clip of 12 frames"]) for name in SHAPES)


def test_two_ranks_agree_on_the_bucket_of_every_step(mixed):
    dm = loaded(mixed, batch_size=2, **BUCKETED)
    buckets = dm.train_dataset().buckets()
    ranks = [BucketSampler(buckets, batch_size=2, seed=0, num_replicas=2, rank=r) for r in (0, 1)]
    assert isinstance(ranks[0], DistributedSampler)  # so Lightning injects no sampler of its own under DDP
    for epoch in range(3):
        for sampler in ranks:
            sampler.set_epoch(epoch)
        steps = [list(sampler) for sampler in ranks]
        assert len(steps[0]) == len(steps[1]) == len(ranks[0]) == 8  # 2+2+2 in one step each, 5 singles
        drawn = collections.Counter()
        for mine, theirs in zip(*steps):
            assert len(mine) == len(theirs) >= 1
            assert {buckets[i] for i, _ in mine} == {buckets[i] for i, _ in theirs} and \
                len({buckets[i] for i, _ in mine}) == 1
            drawn.update(i for i, _ in mine + theirs)
        assert set(drawn) == set(range(11))
        # a bucket of one item gives both ranks that item (DistributedSampler's padding); the others are drawn once
        assert sorted(i for i, n in drawn.items() if n == 2) == [i for i, b in enumerate(buckets)
                                                                  if buckets.count(b) == 1]
    assert dm.bucket_table(num_replicas=2)[-1] == ((9, 64, 16), 2, 1)


# ---------------------------------------------------------------------- training and the cache
class Shapes(Callback):
    def __init__(self):
        self.shapes, self.indices = [], []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.shapes.append(tuple(batch["latents"].shape[2:]) if "latents" in batch else tuple(batch["video"].shape[2:]))
        self.indices.append(batch["index"].tolist())


def finetune() -> Finetune:
    seed_everything(0)
    return Finetune(wan_card(), run=RunArgs(frames=9, height=32, width=32))


def trainer(steps: int, *callbacks, **kwargs) -> Trainer:
    return Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, callbacks=list(callbacks), **kwargs)


def test_finetune_trains_on_buckets_through_the_cards_vae_and_cache(mixed, tmp_path):
    """A real fit of the tiny Wan finetune on the mixed folder: batches of several shapes, each item encoded once
    into the cache at its bucket's size, validation on the held-out items' buckets."""
    shapes = Shapes()
    fit = trainer(4, shapes, enable_checkpointing=False, num_sanity_val_steps=2)
    dm = VideoFolder(mixed, batch_size=2, latents_cache=str(tmp_path / "latents"), val_fraction=0.2, **BUCKETED)
    fit.fit(finetune(), dm)
    assert fit.global_step == 4 and torch.isfinite(fit.callback_metrics["train/loss/transformer"])
    assert len(set(shapes.shapes)) > 1, shapes.shapes  # latents of several buckets: (F', h, w) = (F-1)/4+1, H/4, W/4
    assert all(s in {(1, 6, 10), (1, 8, 8), (2, 4, 16), (2, 8, 8), (2, 16, 4), (3, 4, 16), (3, 8, 8), (3, 16, 4)}
               for s in shapes.shapes), shapes.shapes
    assert len(list((tmp_path / "latents").iterdir())) == 11 and len(dm.val_items) == 2


@pytest.mark.slow
def test_cache_fill_is_shared_by_processes_and_resumes_after_a_kill(mixed, tmp_path, monkeypatch):
    torch.manual_seed(0)
    vae = folder.freeze(build_model("wan_vae"))
    cache = tmp_path / "latents"

    def data():
        return loaded(mixed, batch_size=2, latents_cache=str(cache), **BUCKETED)

    real_save, saved = folder.save_file, []

    def killed_after_three(tensors, path, metadata=None):  # the 4th write dies half-way
        if len(saved) == 3:
            with open(path, "wb") as f:
                f.write(b"half")
            raise KeyboardInterrupt
        saved.append(path)
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(folder, "save_file", killed_after_three)
    with pytest.raises(KeyboardInterrupt):
        data().fill_cache(vae)
    entries = sorted(p.name for p in cache.iterdir() if p.name.endswith(".safetensors"))
    assert len(entries) == 3  # complete entries only; the half-written one kept its temporary name
    assert all(folder.load_file(str(cache / name))["latents"].dim() == 4 for name in entries)
    monkeypatch.setattr(folder, "save_file", real_save)
    # two processes of a node, each its share of what is missing, then each takes every entry
    counts = [data().fill_cache(vae, rank=r, processes=2, record=False) for r in (0, 1)]
    assert sum(counts) == 8 and min(counts) >= 3, counts
    dm = data()
    assert dm.fill_cache(vae) == 0 and len(dm._latents) == 11
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"latents", "prompt", "index", "group"}


def test_options_are_checked_together(tmp_path):
    with pytest.raises(ValueError) as err:
        VideoFolder(str(tmp_path), frame_buckets=[1, 5], frame_window="uniform", frame_stride=2, target_fps=8,
                    datasets=[{"repeats": 0, "frames": 17}, {"root": str(tmp_path)}])
    for part in ("give `root` or `datasets`, not both", "`bucket_area` and `frame_buckets` shape buckets",
                 "give `target_fps` or `frame_stride`, not both", "frame_window='uniform' spreads the frames",
                 "datasets[0]: give `root` (a folder) or `metadata`", "datasets[0].repeats=0",
                 "the datasets ask for 17x32x32 and 9x32x32", ):
        assert part in str(err.value), part
    with pytest.raises(ValueError) as err:
        VideoFolder(datasets=[{"root": str(tmp_path), "frame_buckets": [1, 13]}], buckets=True,
                    frame_window="random", latents_cache=str(tmp_path / "cache"), bucket_area=8, bucket_stride=16)
    for part in ("bucket_area=8 is below one bucket_stride²", "frame_window='random' reads other frames each epoch",
                 "datasets[0].frame_buckets=[1, 13] must be frame counts from 1 to frames=9"):
        assert part in str(err.value), part
    with pytest.raises(ValueError, match="no data: give `root`"):
        VideoFolder()


@pytest.mark.slow
def test_fit_resumed_from_a_checkpoint_draws_the_same_bucket_batches(mixed, tmp_path):
    """A run stopped after 3 iterations and resumed from its checkpoint trains on the batches of the run that went
    straight to 11 (8 bucket batches an epoch: the second epoch included)."""
    def data():  # no validation split (limit_val_batches=0 below: no validation loop to skip)
        return VideoFolder(mixed, batch_size=2, frame_window="random", seed=3, **BUCKETED)

    straight = Shapes()
    trainer(11, straight, enable_checkpointing=False, limit_val_batches=0).fit(finetune(), data())
    first, resumed = Shapes(), Shapes()
    every3 = ModelCheckpoint(dirpath=str(tmp_path / "checkpoints"), every_n_train_steps=3, save_top_k=-1)
    trainer(4, first, every3, default_root_dir=str(tmp_path), limit_val_batches=0).fit(finetune(), data())  # killed after step 4
    step3 = [p for p in (tmp_path / "checkpoints").iterdir() if "step=3" in p.name]
    # the resumed run carries the checkpoint callback whose state the checkpoint holds, as a relaunch does
    again = ModelCheckpoint(dirpath=str(tmp_path / "checkpoints"), every_n_train_steps=3, save_top_k=-1)
    trainer(11, resumed, again, default_root_dir=str(tmp_path), limit_val_batches=0).fit(finetune(), data(), ckpt_path=str(step3[0]))
    assert first.indices[:3] + resumed.indices == straight.indices
    assert first.shapes[:3] + resumed.shapes == straight.shapes and len(set(straight.shapes)) > 3


class RecordBatches(Callback):
    """Append ``<iteration> <frames>x<h>x<w> <indices>`` of every batch to ``<folder>/batches_<rank>.txt``."""

    def __init__(self, folder: str):
        self.folder = folder

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        shape = "x".join(map(str, batch["latents"].shape[2:]))
        with open(os.path.join(self.folder, f"batches_{trainer.global_rank}.txt"), "a") as f:
            f.write(f"{trainer.global_step} {shape} {batch['index'].tolist()}\n")


@pytest.mark.slow
def test_two_processes_fill_the_cache_in_shares_and_agree_on_each_steps_bucket(mixed, tmp_path):
    """``posttrain fit`` on 2 processes (DDP over gloo) with buckets and a latents cache: the processes encode the
    cache between them, and every step both train on the same bucket (their own items of it)."""
    import yaml

    from tests import helpers_strategy as h

    run = str(tmp_path / "run")
    path = h.config(run, None, max_steps=6, callbacks=[{"class_path": "test_buckets.RecordBatches",
                                                        "init_args": {"folder": run}}])
    with open(path) as f:
        cfg = yaml.safe_load(f)
    cfg["model"]["init_args"]["run"] = {"frames": 9, "height": 32, "width": 32}
    cfg["data"] = {"class_path": "posttrain.datamodules.folder.VideoFolder",
                   "init_args": {"root": mixed, "buckets": True, "bucket_stride": 8, "batch_size": 1,
                                 "latents_cache": str(tmp_path / "latents")}}
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    done = h.fit(path, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [open(os.path.join(run, f"batches_{r}.txt")).read().splitlines() for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 6
    for mine, theirs in zip(*ranks):
        assert mine.split()[:2] == theirs.split()[:2], (mine, theirs)  # same iteration, same bucket
    assert len({line.split()[1] for line in ranks[0]}) > 1  # several buckets over the run
    assert len(list((tmp_path / "latents").iterdir())) == 11
    assert "VideoFolder: encoding 6 items into the latents cache" in done.stdout + done.stderr
