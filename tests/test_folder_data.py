"""VideoFolder: real files in, (video | latents, prompt) batches out; the latents cache; every error."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from PIL import Image

import posttrain.datamodules.folder as folder
from posttrain.datamodules.folder import VideoFolder
from posttrain.datamodules.synthetic import COLOURS, render
from posttrain.lit.base import RunArgs
from posttrain.lit.finetune import Finetune
from posttrain.modules.models.cards import Expert
from posttrain.modules.io.media import write_media
from posttrain.modules.models.presets import build_model
from tests.conftest import wan_card

RED = torch.tensor(COLOURS["red"]) * 2 - 1  # the shapes' colours in [-1, 1]
BLUE = torch.tensor(COLOURS["blue"]) * 2 - 1


def clip(path, frames=12, height=24, width=40, colour="red", background="blue"):
    """A real video file (mp4 through imageio-ffmpeg, gif through Pillow) of a shape moving right."""
    return write_media(str(path), render("circle", colour, "right", background, frames, height, width))


def image(path, rgb, size=(40, 20)):
    Image.new("RGB", size, rgb).save(path)
    return str(path)


def caption(media, text):
    with open(os.path.splitext(str(media))[0] + ".txt", "w") as f:
        f.write(text)


@pytest.fixture
def clips(tmp_path):
    """Two mp4s and a gif with .txt captions: 12, 12 and 9 frames of different content."""
    root = tmp_path / "clips"
    root.mkdir()
    for name, n, colour, text in [("a.mp4", 12, "red", "a red circle"), ("b.mp4", 12, "yellow", "  a second clip\n"),
                                  ("c.gif", 9, "red", "gif")]:
        caption(clip(root / name, frames=n, colour=colour), text)
    return root


def counting_encode(monkeypatch):
    calls = []
    real = folder.vae_codec.encode

    def encode(vae, video, *args, **kwargs):
        calls.append(video.shape[0])
        return real(vae, video, *args, **kwargs)

    monkeypatch.setattr(folder.vae_codec, "encode", encode)
    return calls


def saved_vae(path) -> str:
    torch.manual_seed(0)
    build_model("wan_vae").save_pretrained(str(path))
    return str(path)


# ---------------------------------------------------------------------- reading
def test_videos_with_txt_captions_give_synthetic_style_batches(clips):
    dm = VideoFolder(str(clips), frames=5, height=16, width=16, frame_stride=2, batch_size=3)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"video", "prompt", "index", "group"}
    assert batch["video"].shape == (3, 3, 5, 16, 16) and batch["video"].dtype == torch.float32
    assert -1.0 <= batch["video"].min() < -0.5 and 0.5 < batch["video"].max() <= 1.0
    by_name = {os.path.basename(p): c for p, c in dm.train_items}
    assert by_name == {"a.mp4": "a red circle", "b.mp4": "a second clip", "c.gif": "gif"}
    assert sorted(batch["prompt"]) == sorted(by_name.values())
    # pixels survive decoding: the corner is the blue background, and the red circle moves right
    video = dm.train_dataset()[0]["video"]
    assert torch.allclose(video[:, 0, 0, 0], BLUE, atol=0.1)
    red = ((video - RED.view(3, 1, 1, 1)).abs().amax(0) < 0.25).float()  # (F, H, W) red mask
    cols = torch.arange(16).float()
    centre = [(red[f].sum(0) * cols).sum() / red[f].sum() for f in (0, 4)]
    assert centre[1] > centre[0] + 1


def test_frame_stride_picks_every_nth_source_frame(clips):
    one = VideoFolder(str(clips), frames=9, height=16, width=16)
    two = VideoFolder(str(clips), frames=5, height=16, width=16, frame_stride=2)
    one.setup("fit"), two.setup("fit")
    gif = [i for i, (p, _) in enumerate(one.train_items) if p.endswith(".gif")][0]  # lossless frames
    assert torch.equal(one.train_dataset()[gif]["video"][:, ::2], two.train_dataset()[gif]["video"])


def test_images_are_one_frame_videos_resized_and_center_cropped(tmp_path):
    # 40x20 image: green 10-pixel borders left and right, red middle; covering 16x16 keeps only red
    pixels = np.zeros((20, 40, 3), np.uint8)
    pixels[:] = (26, 204, 51)
    pixels[:, 10:30] = (255, 26, 26)
    Image.fromarray(pixels).save(tmp_path / "x.png")
    caption(tmp_path / "x.png", "red")
    caption(image(tmp_path / "y.jpg", (0, 0, 255)), "blue")
    dm = VideoFolder(str(tmp_path), frames=1, height=16, width=16, batch_size=2)
    dm.setup("fit")
    x, y = dm.train_dataset()[0], dm.train_dataset()[1]
    assert x["prompt"] == "red" and x["video"].shape == (3, 1, 16, 16)
    assert (x["video"][0, 0, :, 1:-1] > 0.9).all() and (x["video"][1, 0] < -0.5).all()
    assert torch.allclose(y["video"][:, 0].mean((1, 2)), torch.tensor([-1.0, -1.0, 1.0]), atol=0.05)


def test_repeat_images_makes_still_clips(tmp_path):
    caption(image(tmp_path / "x.png", (255, 0, 0)), "red")
    dm = VideoFolder(str(tmp_path), frames=5, height=8, width=8, repeat_images=True, batch_size=1)
    dm.setup("fit")
    video = dm.train_dataset()[0]["video"]
    assert video.shape == (3, 5, 8, 8) and all(torch.equal(video[:, 0], video[:, f]) for f in range(5))


def test_metadata_jsonl_lists_files_in_subfolders(tmp_path):
    (tmp_path / "sub").mkdir()
    clip(tmp_path / "sub" / "a.mp4", frames=9)
    image(tmp_path / "b.png", (0, 255, 0))
    image(tmp_path / "unlisted.png", (0, 0, 0))  # not in the metadata: not data
    lines = [{"file": "sub/a.mp4", "caption": "clip"}, {"file": "b.png", "caption": " green "}]
    (tmp_path / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n\n")
    dm = VideoFolder(str(tmp_path), frames=1, height=16, width=16, batch_size=2)
    dm.setup("fit")
    assert [(os.path.relpath(p, tmp_path), c) for p, c in dm.train_items] == \
        [(os.path.join("sub", "a.mp4"), "clip"), ("b.png", "green")]


def test_validation_split_by_fraction_and_by_files(clips):
    dm = VideoFolder(str(clips), frames=5, height=8, width=8, val_fraction=0.3, batch_size=2)
    dm.setup("fit")
    assert len(dm.val_items) == 1 and len(dm.train_items) == 2
    assert not set(dm.val_items) & set(dm.train_items)
    assert len(next(iter(dm.val_dataloader()))["prompt"]) == 1
    dm = VideoFolder(str(clips), frames=5, height=8, width=8, val_files=["c.gif"], batch_size=2)
    dm.setup("fit")
    assert [c for _, c in dm.val_items] == ["gif"] and len(dm.train_items) == 2
    assert [b["prompt"] for b in dm.predict_dataloader()] == [["gif"]]
    no_split = VideoFolder(str(clips), frames=5, height=8, width=8)
    no_split.setup("fit")
    assert no_split.val_dataloader() == []


# ---------------------------------------------------------------------- latents cache
@pytest.mark.slow
def test_latents_cache_is_written_once_reused_and_never_stale(clips, tmp_path, monkeypatch):
    calls = counting_encode(monkeypatch)
    cache = tmp_path / "latents"
    vae = Expert(arch="wan_vae", pretrained=saved_vae(tmp_path / "vae"))

    def loaded(**size):
        dm = VideoFolder(str(clips), latents_cache=str(cache), vae=vae, batch_size=3, **size)
        dm.prepare_data()
        dm.setup("fit")
        return dm

    dm = loaded(frames=5, height=16, width=16)
    assert len(calls) == 3 and len(list(cache.iterdir())) == 3
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"latents", "prompt", "index", "group"}
    assert batch["latents"].shape == (3, 16, 2, 4, 4)  # (B, z, (F-1)/4+1, H/4, W/4): the 4x world VAE
    # the cached latents are what the VAE gives for the same pixels
    item = dm.train_dataset()[0]
    model = build_model("wan_vae", pretrained=vae.pretrained).eval()
    pixels = folder.FolderDataset(dm.train_entries).video(0)
    assert torch.allclose(item["latents"], folder.vae_codec.encode(model, pixels[None])[0], atol=1e-5)
    calls.clear()

    loaded(frames=5, height=16, width=16).train_dataloader()  # a new run, same data and size: all hits
    assert calls == [] and len(list(cache.iterdir())) == 3

    stale = loaded(frames=5, height=24, width=16)  # other size: new entries, the old ones are not read
    assert len(calls) == 3 and len(list(cache.iterdir())) == 6
    assert next(iter(stale.train_dataloader()))["latents"].shape == (3, 16, 2, 6, 4)
    calls.clear()

    clip(clips / "a.mp4", frames=12, colour="green")  # edited file: only it is encoded again
    assert len(calls) == 0
    loaded(frames=5, height=16, width=16)
    assert len(calls) == 1 and len(list(cache.iterdir())) == 7


@pytest.mark.slow
def test_finetune_fits_on_a_folder_through_the_cards_vae_and_cache(clips, tmp_path, monkeypatch):
    calls = counting_encode(monkeypatch)
    cache = tmp_path / "latents"
    for name, colour in (("d.mp4", "cyan"), ("e.gif", "green"), ("f.mp4", "magenta")):
        caption(clip(clips / name, frames=9, colour=colour), f"clip {name}")

    seed_everything(0)
    card = wan_card()
    module = Finetune(card, run=RunArgs(frames=5, height=16, width=16))

    def data():
        return VideoFolder(str(clips), frames=5, height=16, width=16, latents_cache=str(cache), val_fraction=0.2,
                           batch_size=2)

    trainer = Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1)
    trainer.fit(module, data())
    assert trainer.global_step == 3
    # 5 train + 1 val items, each encoded once; training itself never ran the VAE (batches carry latents)
    assert len(calls) == 6 and len(list(cache.iterdir())) == 6
    assert torch.isfinite(trainer.callback_metrics["train/loss/transformer"])
    assert "val/loss" in trainer.callback_metrics  # validation ran on cached latents
    # the next run with the same VAE weights finds every entry
    again = data()
    again.setup("fit")
    assert again.fill_cache(card["vae"]) == 0 and len(calls) == 6


# ---------------------------------------------------------------------- errors
def test_missing_and_empty_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data folder .*nowhere.* does not exist"):
        VideoFolder(str(tmp_path / "nowhere")).setup("fit")
    (tmp_path / "notes.md").write_text("not media")
    with pytest.raises(ValueError, match=r"holds no media"):
        VideoFolder(str(tmp_path)).setup("fit")


def test_media_without_caption_and_empty_caption(tmp_path):
    image(tmp_path / "a.png", (0, 0, 0))
    with pytest.raises(ValueError, match=r"a\.png: no caption; add 'a\.txt'"):
        VideoFolder(str(tmp_path), frames=1).setup("fit")
    (tmp_path / "a.txt").write_text("  \n")
    with pytest.raises(ValueError, match=r"a\.txt: empty caption"):
        VideoFolder(str(tmp_path), frames=1).setup("fit")


@pytest.mark.parametrize("line, message", [
    ('{"file": "a.png", "caption": "ok"', r"metadata\.jsonl:2: not valid JSON"),
    ('{"file": "a.png"}', r"metadata\.jsonl:2: expected an object with string \"file\" and \"caption\""),
    ('{"file": "a.png", "caption": " "}', r"metadata\.jsonl:2: empty caption for 'a\.png'"),
    ('{"file": "gone.mp4", "caption": "x"}', r"metadata\.jsonl:2: file 'gone\.mp4' does not exist"),
    ('{"file": "a.txt", "caption": "x"}', r"metadata\.jsonl:2: 'a\.txt' is not a supported media file"),
])
def test_malformed_metadata_names_file_and_line(tmp_path, line, message):
    image(tmp_path / "a.png", (0, 0, 0))
    (tmp_path / "metadata.jsonl").write_text('{"file": "a.png", "caption": "fine"}\n' + line + "\n")
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        VideoFolder(str(tmp_path), frames=1).setup("fit")


def test_empty_metadata(tmp_path):
    (tmp_path / "metadata.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"metadata\.jsonl: holds no entries"):
        VideoFolder(str(tmp_path)).setup("fit")


@pytest.mark.parametrize("name", ["bad.mp4", "bad.png", "bad.gif"])
def test_corrupt_media_file(tmp_path, name):
    (tmp_path / name).write_bytes(b"\x00\x01 not really media" * 10)
    caption(tmp_path / name, "broken")
    with pytest.raises(ValueError, match=rf"{name.replace('.', '[.]')}: cannot read this media file"):
        VideoFolder(str(tmp_path), frames=1).setup("fit")


def test_corrupt_media_file_stops_the_cache_fill(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "bad.mp4").write_bytes(b"\x00" * 64)
    caption(tmp_path / "data" / "bad.mp4", "broken")
    dm = VideoFolder(str(tmp_path / "data"), frames=1, latents_cache=str(tmp_path / "cache"),
                     vae=Expert(arch="wan_vae", pretrained=saved_vae(tmp_path / "vae")))
    with pytest.raises(ValueError, match=r"bad\.mp4: cannot read this media file"):
        dm.prepare_data()
    assert not list((tmp_path / "cache").iterdir())


def test_too_short_video_and_image_with_many_frames(tmp_path):
    caption(clip(tmp_path / "short.mp4", frames=6), "short")
    with pytest.raises(ValueError, match=r"short\.mp4: has 6 frames; frames=5 with frame_stride=2 needs 9"):
        VideoFolder(str(tmp_path), frames=5, frame_stride=2).setup("fit")
    os.remove(tmp_path / "short.mp4")
    caption(image(tmp_path / "still.png", (0, 0, 0)), "still")
    with pytest.raises(ValueError, match=r"still\.png: an image is a 1-frame video but frames=5; set `frames: 1`"):
        VideoFolder(str(tmp_path), frames=5).setup("fit")


def test_bad_options_are_collected(tmp_path):
    with pytest.raises(ValueError) as err:
        VideoFolder(str(tmp_path), frames=0, frame_stride=0, val_fraction=1.0, vae=Expert(arch="umt5"))
    for part in ("frames, height, width = 0, 32, 32", "frame_stride=0", "val_fraction=1.0",
                 "`vae` only fills a `latents_cache`", "vae.arch='umt5' is not a VAE", "without `pretrained`"):
        assert part in str(err.value)
    with pytest.raises(ValueError, match="give `val_fraction` or `val_files`, not both"):
        VideoFolder(str(tmp_path), val_fraction=0.5, val_files=["a.png"])


def test_split_errors(clips):
    with pytest.raises(ValueError, match=r"val_files not in .*\['missing\.mp4'\]"):
        VideoFolder(str(clips), frames=5, val_files=["a.mp4", "missing.mp4"]).setup("fit")
    with pytest.raises(ValueError, match=r"the validation split takes all 3 items"):
        VideoFolder(str(clips), frames=5, val_files=["a.mp4", "b.mp4", "c.gif"]).setup("fit")


def test_cache_with_a_size_the_vae_cannot_encode(clips, tmp_path):
    dm = VideoFolder(str(clips), frames=4, height=16, width=16, latents_cache=str(tmp_path / "cache"),
                     vae=Expert(arch="wan_vae", pretrained=saved_vae(tmp_path / "vae")))
    with pytest.raises(ValueError, match=r"frames=4 must be 4k\+1 \(the VAE compresses time by 4\); e.g. 5"):
        dm.prepare_data()


def test_cache_without_a_vae_outside_a_trainer(clips, tmp_path):
    dm = VideoFolder(str(clips), frames=5, height=8, width=8, latents_cache=str(tmp_path / "cache"))
    dm.setup("fit")
    with pytest.raises(ValueError, match=r"latents_cache needs a VAE"):
        dm.train_dataloader()


# ---------------------------------------------------------------------- config
def test_finetune_folder_config_parses(clips, tmp_path, monkeypatch):
    from posttrain.lit.tools.config import PosttrainCLI

    config = os.path.join(os.path.dirname(__file__), "..", "configs", "finetune_folder.yaml")
    monkeypatch.chdir(tmp_path)
    cli = PosttrainCLI(args=["--config", os.path.abspath(config), "--data.init_args.root", str(clips)],
                       run=False)
    assert isinstance(cli.datamodule, VideoFolder) and isinstance(cli.model, Finetune)
    assert cli.datamodule.root == str(clips) and cli.datamodule.latents_cache is not None
    assert (cli.datamodule.frames, cli.datamodule.height, cli.datamodule.width) == \
        (cli.model.video.frames, cli.model.video.height, cli.model.video.width)


@pytest.mark.slow
def test_finetune_folder_with_a_one_frame_run_trains_on_images(tmp_path, monkeypatch):
    """configs/finetune_folder.yaml with `run: {frames: 1}` (the YAML edited, as a user would) on a folder of
    images: the data takes the run's one frame and `posttrain fit` trains (before, VideoFolder kept frames=9 and
    refused every image "but frames=9")."""
    import yaml

    from posttrain.lit.tools.cli import main

    root = tmp_path / "images"
    root.mkdir()
    for i, rgb in enumerate([(255, 0, 0), (0, 0, 255), (0, 255, 0), (255, 255, 0)]):
        caption(image(root / f"{i}.png", rgb, size=(48, 40)), f"image {i}")
    config = os.path.join(os.path.dirname(__file__), "..", "configs", "finetune_folder.yaml")
    with open(config) as f:
        cfg = yaml.safe_load(f)
    cfg["model"]["init_args"]["run"]["frames"] = 1
    path = tmp_path / "images.yaml"
    path.write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    # returns (no SystemExit): the run trained
    main(["fit", "--config", str(path), "--trainer.max_steps=1", "--trainer.logger=false",
          "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
          f"--trainer.default_root_dir={run}", f"--data.init_args.root={root}",
          f"--data.init_args.latents_cache={tmp_path / 'latents'}", "--data.init_args.batch_size=2"])
    latents = [folder.load_file(str(p))["latents"] for p in (tmp_path / "latents").iterdir()]
    assert len(latents) == 4 and all(z.shape[1] == 1 for z in latents)  # (z, F'=1, h, w): one frame each
