"""Folders of real captioned videos and images, as they come: several sizes, lengths and frame rates, some broken.

Where the data is (``root``, or a ``datasets`` list of folders and metadata files, each with its own repeats,
caption prefix and frame settings), each searched recursively in one of two layouts:

* media files with a caption file of the same stem: ``clip.mp4`` + ``clip.txt``, ``cat.png`` + ``cat.txt``;
* a ``metadata.jsonl`` with one ``{"file": "clips/a.mp4", "caption": "..."}`` per line, or a ``metadata.csv`` with
  the columns ``file`` and ``caption``, paths relative to the folder. When it exists it alone lists the data.

Every item becomes a ``(3, F, H, W)`` video in [-1, 1]: ``F`` source frames chosen by ``frame_window`` (the clip's
first frames, a window at a random start drawn from the data position, or frames spread over the whole clip), taken
every ``frame_stride`` source frames or resampled to ``target_fps``, then resized so that it covers ``(H, W)`` and
centre-cropped. Without buckets ``(F, H, W)`` is ``(frames, height, width)`` for every item. With ``buckets``, ``H, W``
is the aspect-ratio bucket nearest the item's own (sizes of about ``bucket_area`` pixels, multiples of
``bucket_stride``) and ``F`` the longest of ``frame_buckets`` the clip fills; each batch is drawn from one bucket
(``sampling.BucketSampler``), so a vertical phone clip keeps its frame. An image is a one-frame clip where one frame is
taken (``frames: 1``, or a frame bucket of 1), else a still clip of ``frames`` copies with ``repeat_images``.

A clip too short for its frames, a file that does not decode, an image where the run takes clips: such an item is
skipped, all of them named in one warning at start-up (before the model is built, except what only encoding the
latents cache finds); ``strict: true`` stops at the first instead, naming the file and the fix.

With ``latents_cache`` set, each item is encoded once with the frozen VAE (distribution mode, as
``modules/models/vae.py``'s ``encode``) into ``<latents_cache>/<key>.safetensors``, where ``key`` hashes the file's
bytes, the item's size and frame options and the VAE's weights. Each local process encodes its share, written
atomically (temporary name, then rename), so a killed fill resumes where it stopped. Batches then carry ``"latents"``
(B, z, F', h, w) instead of ``"video"``, and ``posttrain.lit.finetune.Finetune`` skips its own VAE pass. Changing the
size options or the VAE changes every key, so a stale entry is never read (it stays on disk, unused).
"""
from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import subprocess
from dataclasses import dataclass, fields, replace
from typing import Literal, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, Dataset

from posttrain.datamodules.sampling import Batched, BucketLoader, BucketSampler, ResumableDataModule
from posttrain.modules.io import batch as batch_schema
from posttrain.modules.models import presets
from posttrain.modules.models import vae as vae_codec
from posttrain.modules.models.cache import file_hash
from posttrain.modules.models.cards import Expert, freeze

VIDEO_EXTS = (".mp4", ".mov", ".webm", ".mkv", ".gif")
IMAGE_EXTS = (".png", ".jpg", ".jpeg")
METADATA = "metadata.jsonl"
METADATA_CSV = "metadata.csv"
METADATA_LINE = ('each line is one JSON object, keys and strings in double quotes, the path relative to the folder: '
                 '{"file": "clips/a.mp4", "caption": "a red circle moving left"}')
CSV_HEADER = 'the first line names the columns, at least `file,caption`; then one `clips/a.mp4,"a red circle"` a line'
CACHE_FORMAT = 1  # bump when the stored latents change meaning
SKIP_MARK = ".unusable"  # beside a cache entry's name: the file could not be encoded (its reason inside)
Window = Literal["first", "random", "uniform"]


# ---------------------------------------------------------------------- several datasets
@dataclass
class FolderSet:
    """One entry of ``VideoFolder(datasets=[...])``: where its items are, how often they count, and the settings it
    gives its own value (None: the ``VideoFolder``'s).

    Args:
        root: a folder (``.txt`` captions beside the media, or its own ``metadata.jsonl`` / ``metadata.csv``).
        metadata: a ``.jsonl`` or ``.csv`` file listing the items, paths relative to ``root`` when given, else to
            the file's folder.
        repeats: each item counts this many times per epoch (a small set weighed up against a large one).
        caption_prefix: put before every caption of the set (a trigger word: ``"ohwx man, "``; include the
            separator).
        frames, height, width, frame_stride, frame_window, target_fps, repeat_images, frame_buckets: as the
            ``VideoFolder`` options, for this set only.
    """
    root: Optional[str] = None
    metadata: Optional[str] = None
    repeats: int = 1
    caption_prefix: str = ""
    frames: Optional[int] = None
    height: Optional[int] = None
    width: Optional[int] = None
    frame_stride: Optional[int] = None
    frame_window: Optional[Window] = None
    target_fps: Optional[float] = None
    repeat_images: Optional[bool] = None
    frame_buckets: Optional[list[int]] = None


OWN_SETTINGS = ("frames", "height", "width", "frame_stride", "frame_window", "target_fps", "repeat_images",
                "frame_buckets")


@dataclass(frozen=True)
class _Settings:
    """What turns the files of one set into items (the VideoFolder's options with the set's own on top)."""
    frames: int
    height: int
    width: int
    frame_stride: int
    frame_window: str
    target_fps: Optional[float]
    repeat_images: bool
    frame_buckets: Optional[tuple[int, ...]]  # None: buckets off, every clip takes `frames`
    sizes: Optional[tuple[tuple[int, int], ...]]  # aspect-ratio buckets (height, width); None: buckets off
    root: Optional[str] = None
    metadata: Optional[str] = None
    repeats: int = 1
    caption_prefix: str = ""

    @property
    def base(self) -> str:
        """The folder item paths are relative to."""
        return self.root if self.root is not None else os.path.dirname(os.path.abspath(self.metadata))

    def where(self) -> str:
        return repr(self.metadata if self.metadata is not None else self.root)


def default_frame_buckets(frames: int) -> list[int]:
    """1 (images), then 5, 9, 17, 33, 65, … below ``frames`` (each 4k+1, as a Wan VAE takes), then ``frames``."""
    buckets, f = [1], 5
    while f < frames:
        buckets.append(f)
        f = 2 * f - 1
    return buckets + [frames] if frames > 1 else buckets


def resolution_buckets(area: int, stride: int) -> list[tuple[int, int]]:
    """(height, width) sizes of about ``area`` pixels, sides multiples of ``stride``, aspect ratios 1:4 to 4:1 in
    ``stride`` steps of the shorter side (musubi-tuner's ``BucketSelector``: the short side from ``√area / 2`` to
    ``√area``, the long side ``area / short`` rounded down to the stride)."""
    side = math.isqrt(area)
    smallest = max(stride, side // 2 // stride * stride)
    sizes = set()
    for short in range(smallest, side + 1, stride):
        long = max(stride, area // short // stride * stride)
        sizes |= {(short, long), (long, short)}
    return sorted(sizes)


def nearest_size(sizes: tuple[tuple[int, int], ...], height: int, width: int) -> tuple[int, int]:
    """The bucket whose aspect ratio is nearest ``height / width`` (in log ratio; the first of a tie)."""
    ratio = math.log(height / width)
    return min(sizes, key=lambda s: abs(math.log(s[0] / s[1]) - ratio))


# ---------------------------------------------------------------------- listing and captions
def _is_media(name: str) -> bool:
    return name.lower().endswith(VIDEO_EXTS + IMAGE_EXTS)


def list_items(root: str) -> list[tuple[str, str]]:
    """(media path, caption) pairs of ``root``, sorted by path; errors name the file (and line)."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"VideoFolder: data folder {root!r} does not exist; point `root` at your clips "
                                f"(clip.mp4 + clip.txt pairs, or a metadata.jsonl): --data.init_args.root "
                                f"/path/to/clips, or the `root` of that entry of `datasets`")
    listed = [os.path.join(root, name) for name in (METADATA, METADATA_CSV) if os.path.isfile(os.path.join(root, name))]
    if len(listed) == 2:
        raise ValueError(f"VideoFolder: {root!r} holds both {METADATA} and {METADATA_CSV}; keep the one that lists "
                         f"the data")
    if listed:
        return read_metadata(root, listed[0])
    items = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            if not _is_media(name):
                continue
            path = os.path.join(folder, name)
            txt = os.path.splitext(path)[0] + ".txt"
            if not os.path.isfile(txt):
                raise ValueError(f"{path}: no caption; add {os.path.basename(txt)!r} beside it "
                                 f"or list the data in {os.path.join(root, METADATA)}")
            try:
                with open(txt, encoding="utf-8") as f:
                    caption = f.read().strip()
            except UnicodeDecodeError as err:
                raise ValueError(f"{txt}: caption is not UTF-8 text (byte {err.start}: {err.reason}); save it as "
                                 f"UTF-8") from err
            if not caption:
                raise ValueError(f"{txt}: empty caption")
            items.append((path, caption))
    if not items:
        raise ValueError(f"VideoFolder: {root!r} holds no media ({', '.join(VIDEO_EXTS + IMAGE_EXTS)}) "
                         f"and no {METADATA}: put videos or images there (a caption in a .txt of the same name, or "
                         f"{METADATA}), or point `root` at another folder")
    return items


def read_metadata(base: str, metadata: str) -> list[tuple[str, str]]:
    """(media path, caption) of each line of a ``.jsonl`` or ``.csv`` metadata file, paths relative to ``base``."""
    if not os.path.isfile(metadata):
        raise FileNotFoundError(f"VideoFolder: metadata file {metadata!r} does not exist")
    if metadata.lower().endswith(".csv"):
        records = _csv_records(metadata)
    elif metadata.lower().endswith(".jsonl"):
        records = _jsonl_records(metadata)
    else:
        raise ValueError(f"VideoFolder: metadata file {metadata!r} is neither .jsonl nor .csv")
    items = []
    for lineno, file, caption in records:
        if not caption.strip():
            raise ValueError(f"{metadata}:{lineno}: empty caption for {file!r}")
        path = os.path.join(base, file)
        if not _is_media(path):
            raise ValueError(f"{metadata}:{lineno}: {file!r} is not a supported media file "
                             f"({', '.join(VIDEO_EXTS + IMAGE_EXTS)})")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{metadata}:{lineno}: file {file!r} does not exist (looked for {path})")
        items.append((path, caption.strip()))
    if not items:
        raise ValueError(f"{metadata}: holds no entries")
    return items


def _jsonl_records(metadata: str) -> list[tuple[int, str, str]]:
    records = []
    with open(metadata, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{metadata}:{lineno}: not valid JSON ({err.msg}, column {err.colno}): {line[:80]!r}; "
                                 f"{METADATA_LINE}") from err
            if not isinstance(record, dict) or not isinstance(record.get("file"), str) \
                    or not isinstance(record.get("caption"), str):
                raise ValueError(f"{metadata}:{lineno}: expected an object with string \"file\" and \"caption\", "
                                 f"got {line[:80]!r}; {METADATA_LINE}")
            records.append((lineno, record["file"], record["caption"]))
    return records


def _csv_records(metadata: str) -> list[tuple[int, str, str]]:
    records = []
    with open(metadata, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        columns = [c.strip() for c in reader.fieldnames or []]
        if "file" not in columns or "caption" not in columns:
            raise ValueError(f"{metadata}:1: columns {columns} lack `file` or `caption`; {CSV_HEADER}")
        reader.fieldnames = columns
        for row in reader:
            if not any((v or "").strip() for v in row.values() if isinstance(v, str)):
                continue
            if row.get("file") is None or row.get("caption") is None:
                raise ValueError(f"{metadata}:{reader.line_num}: fewer values than columns; {CSV_HEADER}")
            records.append((reader.line_num, row["file"].strip(), row["caption"]))
    return records


# ---------------------------------------------------------------------- what a file holds
class Unusable(ValueError):
    """A file this run cannot take (skipped, or with ``strict`` the error); the message names no path."""

    def __init__(self, reason: str, kind: str):
        super().__init__(reason)
        self.kind = kind  # "unreadable", "too short", "images in a clip run", "no frame rate"


@dataclass(frozen=True)
class Probe:
    """What a media file holds: still image or clip, its source frames (counted up to what the run needs; None:
    not counted), frame rate (None: unknown) and pixel size (None: not opened)."""
    image: bool
    frames: Optional[int] = None
    fps: Optional[float] = None
    height: Optional[int] = None
    width: Optional[int] = None


def probe(path: str, level: str, limit=None) -> Probe:
    """Open ``path`` as far as ``level`` asks: ``"decode"`` decodes up to ``limit(fps)`` frames (None: every frame);
    ``"header"`` reads the size, the frame rate and the container's frame count, decoding one frame; ``"none"``
    reads nothing. An unreadable file raises ``Unusable`` with what the decoder said and the fix."""
    is_image = path.lower().endswith(IMAGE_EXTS)
    if level == "none":
        return Probe(image=is_image)
    try:
        if path.lower().endswith(IMAGE_EXTS + (".gif",)):
            return _probe_pil(path, is_image, level, limit)
        return _probe_ffmpeg(path, level, limit)
    except Exception as err:  # decoders raise OSError, RuntimeError, ValueError…: name the fix
        fix = (IMAGE_FIX if is_image else VIDEO_FIX).format(name=os.path.basename(path))
        raise Unusable(f"cannot read this media file ({_decoder_problem(path, err)}); {fix}", "unreadable") from err


def _probe_pil(path: str, is_image: bool, level: str, limit) -> Probe:
    from PIL import Image, ImageSequence

    with Image.open(path) as im:
        width, height = im.size
        duration = im.info.get("duration")  # a GIF's milliseconds per frame
        fps = 1000.0 / duration if not is_image and duration else None
        if is_image:
            if level == "decode":
                im.convert("RGB")
            return Probe(image=True, frames=1, height=height, width=width)
        if level == "header":
            return Probe(image=False, frames=getattr(im, "n_frames", 1), fps=fps, height=height, width=width)
        stop, count = limit(fps) if limit else None, 0
        for frame in ImageSequence.Iterator(im):
            frame.convert("RGB")
            count += 1
            if count == stop:
                break
    return Probe(image=False, frames=count, fps=fps, height=height, width=width)


def _probe_ffmpeg(path: str, level: str, limit) -> Probe:
    import imageio.v2 as imageio

    with imageio.get_reader(path, format="ffmpeg") as reader:
        fps = reader.get_meta_data().get("fps") or None
        stop = 1 if level == "header" else limit(fps) if limit else None
        count, shape = 0, None
        for frame in reader:
            shape = frame.shape
            count += 1
            if count == stop:
                break
    if shape is None:
        raise ValueError("no video frame decodes")
    if level == "header":
        count = _container_frames(path)
    return Probe(image=False, frames=count, fps=fps, height=shape[0], width=shape[1])


def _container_frames(path: str) -> int:
    """Frames of the first video stream, counted by ffmpeg from the packets (demuxed, not decoded)."""
    import imageio_ffmpeg

    out = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-nostdin", "-i", path, "-map", "0:v:0", "-c", "copy",
                          "-f", "null", "-"], capture_output=True, text=True, errors="replace")
    counts = [line.split("frame=", 1)[1].split()[0] for line in out.stderr.replace("\r", "\n").splitlines()
              if "frame=" in line]
    if out.returncode != 0 or not counts:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "ffmpeg counted no frames")
    return int(counts[-1])


# ---------------------------------------------------------------------- one item: its frames and size
@dataclass(frozen=True)
class Entry:
    """One usable file as this run reads it: which source frames (``window`` over ``available`` source frames, one
    output frame every ``step`` of them) at which output size ``(frames, height, width)``."""
    path: str
    caption: str
    image: bool
    frames: int
    height: int
    width: int
    available: int  # source frames (1 for an image; 0: not counted)
    step: float  # source frames per output frame: frame_stride, or source fps / target_fps
    window: str
    frame_stride: int
    target_fps: Optional[float]
    repeat_images: bool
    repeats: int = 1
    dataset: int = 0  # which entry of `datasets`

    @property
    def bucket(self) -> tuple[int, int, int]:
        return self.frames, self.height, self.width


def _span(frames: int, step: float) -> int:
    """Source frames a window of ``frames`` output frames covers."""
    return math.floor((frames - 1) * step + 0.5) + 1


def frame_indices(entry: Entry, rng: Optional[np.random.Generator] = None) -> list[int]:
    """The source frames of ``entry``: from frame 0 (``first``), from a start drawn by ``rng`` (``random``), or
    ``frames`` of them spread evenly from the first to the last (``uniform``); one every ``step`` source frames,
    each the nearest to its time."""
    if entry.image:
        return [0] * entry.frames
    if entry.window == "uniform":
        return np.linspace(0, entry.available - 1, entry.frames).round().astype(int).tolist()
    start = 0
    if entry.window == "random":
        start = int(rng.integers(0, entry.available - _span(entry.frames, entry.step) + 1))
    return [start + math.floor(i * entry.step + 0.5) for i in range(entry.frames)]


def plan(path: str, caption: str, found: Probe, s: _Settings, dataset: int = 0) -> Entry:
    """The entry of one probed file under settings ``s``, or ``Unusable`` saying why this run cannot take it."""
    step = float(s.frame_stride)
    if found.image:
        takes_one = s.frames == 1 or (s.frame_buckets is not None and 1 in s.frame_buckets)
        if not takes_one and not s.repeat_images:
            raise Unusable(f"an image is a 1-frame video but frames={s.frames}; set `frames: 1`, or `repeat_images: "
                           f"true` for a still clip", "images in a clip run")
        frames, available = (1 if takes_one else s.frames), 1
    else:
        if s.target_fps is not None:
            if not found.fps:
                raise Unusable(f"its frame rate is unknown, so it cannot be resampled to target_fps={s.target_fps:g}; "
                               f"re-encode it with a frame rate (`ffmpeg -i SOURCE -r 16 …`), or drop target_fps",
                               "no frame rate")
            step = found.fps / s.target_fps
        lengths = [s.frames] if s.frame_buckets is None else \
            sorted([f for f in s.frame_buckets if f > 1] or list(s.frame_buckets), reverse=True)
        available = found.frames or 0
        fits = [f for f in lengths if (f if s.frame_window == "uniform" else _span(f, step)) <= available]
        if found.frames is None:  # not counted (check_files off, nothing asked for the length): trusted
            fits, available = lengths, 0
        if not fits:
            shortest = lengths[-1]
            takes = f"frames={shortest}" if s.frame_buckets is None else f"the shortest frame bucket, {shortest},"
            if s.frame_window == "uniform":
                needs = f"{takes} spread over the clip needs {shortest}"
            elif s.target_fps is not None:
                needs = (f"{takes} at target_fps={s.target_fps:g} needs {_span(shortest, step)} "
                         f"(at its {found.fps:g} fps)")
            else:
                needs = f"{takes} with frame_stride={s.frame_stride} needs {_span(shortest, step)}"
            raise Unusable(f"has {available} frames; {needs}", "too short")
        frames = fits[0]
    height, width = (s.height, s.width) if s.sizes is None else nearest_size(s.sizes, found.height, found.width)
    return Entry(path, s.caption_prefix + caption, found.image, frames, height, width, available, step,
                 s.frame_window, s.frame_stride, s.target_fps, s.repeat_images, s.repeats, dataset)


# ---------------------------------------------------------------------- decoding
def read_frames(path: str, frames: int, frame_stride: int = 1, repeat_images: bool = False) -> np.ndarray:
    """(frames, H, W, 3) uint8: source frames 0, s, 2s, … of a clip, or an image as 1 (or repeated) frame."""
    is_image = path.lower().endswith(IMAGE_EXTS)
    if is_image and frames > 1 and not repeat_images:
        raise ValueError(f"{path}: an image is a 1-frame video but frames={frames}; "
                         f"set `frames: 1`, or `repeat_images: true` for a still clip")
    entry = Entry(path, "", is_image, frames, 0, 0, 0, float(frame_stride), "first", frame_stride, None,
                  repeat_images)
    return read_entry(entry)


def read_entry(entry: Entry, rng: Optional[np.random.Generator] = None) -> np.ndarray:
    """(F, H, W, 3) uint8 source frames of ``entry`` (``rng`` draws a random window's start)."""
    indices = frame_indices(entry, rng)
    try:
        source = _decode(entry.path, max(indices) + 1)
    except Exception as err:  # decoders raise OSError, RuntimeError, ValueError…: name the file and the fix
        fix = (IMAGE_FIX if entry.image else VIDEO_FIX).format(name=os.path.basename(entry.path))
        raise ValueError(f"{entry.path}: cannot read this media file ({_decoder_problem(entry.path, err)}); "
                         f"{fix}") from err
    if len(source) <= max(indices):
        raise ValueError(f"{entry.path}: has {len(source)} frames; frames={entry.frames} with "
                         f"frame_stride={entry.frame_stride} needs {max(indices) + 1}")
    return np.stack([source[i] for i in indices])


VIDEO_FIX = ("replace it with a readable copy (download it again, or re-encode its source: `ffmpeg -i SOURCE -c:v "
             "libx264 -pix_fmt yuv420p {name}`), or remove it (and its caption or metadata line) from the folder")
IMAGE_FIX = ("replace it with a readable PNG or JPEG (save it again from its source), or remove it (and its caption or "
             "metadata line) from the folder")


def _decoder_problem(path: str, err: Exception) -> str:
    """What the decoder said, in one line: ffmpeg's error is its first line and the last line of the stderr it
    appends (its banner and build configuration dropped)."""
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        return "it is empty: 0 bytes"
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    said = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    if len(lines) > 1 and "=== stderr ===" in lines:
        said += f"; ffmpeg: {lines[-1]}"
    return said


def _decode(path: str, limit: int) -> list[np.ndarray]:
    """Up to ``limit`` RGB frames: Pillow for images and GIFs, imageio-ffmpeg for the video containers."""
    source = []
    if path.lower().endswith(IMAGE_EXTS + (".gif",)):
        from PIL import Image, ImageSequence

        with Image.open(path) as im:
            for frame in ImageSequence.Iterator(im):
                source.append(np.asarray(frame.convert("RGB")))
                if len(source) == limit:
                    break
    else:
        import imageio.v2 as imageio

        with imageio.get_reader(path, format="ffmpeg") as reader:
            for frame in reader:
                source.append(np.asarray(frame)[..., :3])
                if len(source) == limit:
                    break
    return source


def to_video(frames: np.ndarray, height: int, width: int) -> torch.Tensor:
    """(F, H, W, 3) uint8 -> (3, F, height, width) float in [-1, 1]: resize to cover, then center-crop."""
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).float()  # (F, 3, H, W)
    h, w = x.shape[-2:]
    scale = max(height / h, width / w)
    size = (max(height, round(h * scale)), max(width, round(w * scale)))
    if size != (h, w):
        x = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
    top, left = (size[0] - height) // 2, (size[1] - width) // 2
    x = x[..., top:top + height, left:left + width].clamp(0, 255)
    return (x / 127.5 - 1).permute(1, 0, 2, 3).contiguous()


def weights_hash(model: torch.nn.Module) -> str:
    """Identity of a VAE: its class, config and every weight's bytes (a re-initialised preset differs)."""
    digest = hashlib.sha256(type(model).__name__.encode())
    digest.update(json.dumps(dict(getattr(model, "config", {})), sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


class FolderDataset(Dataset):
    """Entries in the batch schema (``modules/io/batch.py``), with ``video`` or ``latents``.

    Index ``k`` is one sample of the epoch: an entry with ``repeats: r`` has ``r`` of them (``order[k]`` is its
    entry). A key may be ``(k, epoch)``: a random frame window then starts where ``(seed, epoch, k)`` draws, so the
    same data position reads the same frames in a resumed run and on any worker."""

    def __init__(self, entries: list[Entry], latents: Optional[list[str]] = None, seed: int = 0):
        self.entries, self.latents, self.seed = entries, latents, seed
        self.order = [i for i, entry in enumerate(entries) for _ in range(entry.repeats)]

    def __len__(self) -> int:
        return len(self.order)

    def buckets(self) -> list[tuple[int, int, int]]:
        """(frames, height, width) of every sample."""
        return [self.entries[i].bucket for i in self.order]

    def video(self, key: Union[int, tuple[int, int]]) -> torch.Tensor:
        index, epoch = key if isinstance(key, (tuple, list)) else (key, 0)
        entry = self.entries[self.order[index]]
        rng = np.random.default_rng([self.seed, epoch, index]) if entry.window == "random" else None
        return to_video(read_entry(entry, rng), entry.height, entry.width)

    def __getitem__(self, key: Union[int, tuple[int, int]]) -> dict:
        index = key[0] if isinstance(key, (tuple, list)) else key
        entry = self.order[index]
        prompt = self.entries[entry].caption
        if self.latents is not None:
            return batch_schema.item(prompt, index, latents=load_file(self.latents[entry])["latents"])
        return batch_schema.item(prompt, index, video=self.video(key))


# ---------------------------------------------------------------------- datamodule
class VideoFolder(ResumableDataModule):
    """Captioned real videos/images from folders (``.txt`` beside each file, or a ``metadata.jsonl`` / ``.csv``).

    Args:
        root: the data folder (or give ``datasets``).
        frames: frames per sample (Wan VAE: 4k+1; 1 for images); with buckets, the longest frame bucket.
        height, width: output size in pixels; each item is resized to cover it and center-cropped. With buckets,
            ``height × width`` is the pixel area of the aspect-ratio buckets. The ``posttrain`` command sets frames,
            height and width from ``model.init_args.run``.
        frame_stride: take every ``frame_stride``-th source frame.
        repeat_images: where the run takes clips, make an image a still clip of ``frames`` copies instead of
            skipping it.
        frame_window: which frames of a longer clip: its ``first``; a ``random`` window (its start drawn from the
            seed, the epoch and the sample, so a resumed run reads the same frames); or ``uniform``: ``frames``
            frames spread evenly over the whole clip.
        target_fps: resample every clip to this frame rate (read from its container) instead of ``frame_stride``;
            None keeps the source frames.
        buckets: batch items by size: aspect-ratio buckets around ``bucket_area`` and frame-count buckets
            ``frame_buckets``, each batch from one bucket. False: every item at ``(frames, height, width)``.
        bucket_area: pixels per frame of the aspect-ratio buckets; None: ``height × width``.
        bucket_stride: bucket sides are multiples of it (the VAE's spatial factor times the transformer's patch:
            16 for Wan 2.1, 8 for the tiny world's Wan).
        frame_buckets: frame counts a clip may take, the longest it fills (images take 1 when listed); None:
            1, 5, 9, 17, 33, … up to ``frames``.
        datasets: several sources, each a ``FolderSet`` (``root`` or ``metadata``, ``repeats``,
            ``caption_prefix`` and its own frame settings), instead of ``root``.
        strict: stop at the first file this run cannot take (too short, unreadable, an image in a clip run)
            instead of skipping it with a warning.
        latents_cache: folder of precomputed VAE latents; batches then carry ``latents``, not ``video``.
        vae: the VAE that fills the cache in ``prepare_data``, loaded here from its ``pretrained`` folder.
            None: the ``vae`` expert of the model's card, used when the first dataloader is built.
        encode_device: device of the cache encoding with ``vae``; None = cuda when available.
        val_fraction: share of items held out for validation (seeded by ``seed``); at least one item stays for
            training, and a single item is not split.
        val_files: held-out items by path relative to their folder, or absolute (instead of ``val_fraction``).
        check_files: decode every item at setup (as far as its frames go), so a bad file is found before training
            (with a ``latents_cache``, the header is read at setup and filling the cache decodes the rest).
        batch_size, num_workers, seed: loader settings; ``seed`` fixes the order, the split and random windows.
    """

    def __init__(self, root: Optional[str] = None, frames: int = 9, height: int = 32, width: int = 32,
                 frame_stride: int = 1, repeat_images: bool = False, frame_window: Window = "first",
                 target_fps: Optional[float] = None, buckets: bool = False, bucket_area: Optional[int] = None,
                 bucket_stride: int = 16, frame_buckets: Optional[list[int]] = None,
                 datasets: Optional[list[FolderSet]] = None, strict: bool = False,
                 latents_cache: Optional[str] = None, vae: Optional[Expert] = None,
                 encode_device: Optional[str] = None, val_fraction: float = 0.0,
                 val_files: Optional[list[str]] = None, check_files: bool = True, batch_size: int = 4,
                 num_workers: int = 0, seed: int = 0):
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        problems, sets = [], []
        for i, fs in enumerate(datasets or []):
            try:
                sets.append(fs if isinstance(fs, FolderSet) else FolderSet(**fs))
            except TypeError:
                problems.append(f"datasets[{i}]: unknown option among {sorted(fs)}; a dataset takes "
                                f"{', '.join(f.name for f in fields(FolderSet))}")
        if root is None and not sets:
            problems.append("no data: give `root` (a folder) or `datasets` (a list of {root: ...} or {metadata: ...})")
        if root is not None and sets:
            problems.append("give `root` or `datasets`, not both (list the folder as one more dataset: "
                            f"{{root: {root}}})")
        if frames < 1 or height < 1 or width < 1:
            problems.append(f"frames, height, width = {frames}, {height}, {width} must be >= 1")
        if bucket_stride < 1:
            problems.append(f"bucket_stride={bucket_stride} must be >= 1")
        area = bucket_area if bucket_area is not None else height * width
        if buckets and bucket_stride >= 1 and area < bucket_stride ** 2:
            problems.append(f"bucket_area={area} is below one bucket_stride² ({bucket_stride}² = "
                            f"{bucket_stride ** 2})")
        if not buckets and (bucket_area is not None or frame_buckets is not None
                            or any(s.frame_buckets is not None for s in sets)):
            problems.append("`bucket_area` and `frame_buckets` shape buckets: set `buckets: true`, or drop them")
        if not 0.0 <= val_fraction < 1.0:
            problems.append(f"val_fraction={val_fraction} must be in [0, 1)")
        if val_fraction > 0 and val_files:
            problems.append("give `val_fraction` or `val_files`, not both")
        if vae is not None and latents_cache is None:
            problems.append("`vae` only fills a `latents_cache`; set `latents_cache: <folder>` or drop `vae`")
        if vae is not None and vae.arch not in presets.archs("vae"):
            problems.append(f"vae.arch={vae.arch!r} is not a VAE; use {' or '.join(map(repr, presets.archs('vae')))}")
        if vae is not None and vae.pretrained is None:
            problems.append("`vae` without `pretrained` is a random preset, unlike the model's VAE and new each run; "
                            "give `vae.pretrained: <folder>`, or drop `vae` to encode with the model card's `vae`")
        top = _Settings(frames, height, width, frame_stride, frame_window, target_fps, repeat_images,
                        tuple(frame_buckets) if frame_buckets is not None else None, None, root=root)
        problems += _setting_problems(top, "", latents_cache)
        self._sets: list[_Settings] = []
        for i, fs in enumerate(sets or [FolderSet(root=root)]):
            s, set_problems = _resolve(top, fs, f"datasets[{i}]." if sets else "", latents_cache)
            problems += [p for p in set_problems if p not in problems]
            if buckets and bucket_stride >= 1 and min(s.frames, s.height, s.width) >= 1:
                # a set with its own height/width has its own area; the others share bucket_area
                set_area = s.height * s.width if (fs.height, fs.width) != (None, None) else area
                s = replace(s, frame_buckets=s.frame_buckets or tuple(default_frame_buckets(s.frames)),
                            sizes=tuple(resolution_buckets(max(set_area, bucket_stride ** 2), bucket_stride)))
            self._sets.append(s)
        if not buckets and len({(s.frames, s.height, s.width) for s in self._sets}) > 1:
            sizes = sorted({f"{s.frames}x{s.height}x{s.width}" for s in self._sets})
            problems.append(f"the datasets ask for {' and '.join(sizes)} (frames x height x width), but without "
                            f"buckets a batch holds one size; set `buckets: true`, or give them one size")
        if problems:
            raise ValueError("VideoFolder:\n  - " + "\n  - ".join(problems))
        self.root, self.frames, self.height, self.width = root, frames, height, width
        self.frame_stride, self.repeat_images = frame_stride, repeat_images
        self.frame_window, self.target_fps = frame_window, target_fps
        self.buckets, self.bucket_area, self.bucket_stride, self.frame_buckets = \
            buckets, bucket_area, bucket_stride, frame_buckets
        self.datasets, self.strict = sets or None, strict
        self.latents_cache, self.vae, self.encode_device = latents_cache, vae, encode_device
        self.val_fraction, self.val_files, self.check_files = val_fraction, val_files, check_files
        self.train_entries: Optional[list[Entry]] = None
        self.val_entries: list[Entry] = []
        self.skipped: list[tuple[str, str]] = []  # (path, why) of every file this run does not take
        self._latents: dict[Entry, str] = {}  # entry -> cache file, once encoded
        self._datasets: dict[str, FolderDataset] = {}

    @property
    def train_items(self) -> Optional[list[tuple[str, str]]]:
        """(path, caption) of each training entry (after skipping and the split); None before ``setup``."""
        return None if self.train_entries is None else [(e.path, e.caption) for e in self.train_entries]

    @property
    def val_items(self) -> list[tuple[str, str]]:
        return [(e.path, e.caption) for e in self.val_entries]

    @property
    def keys_with_epoch(self) -> bool:  # a random window draws from the data position
        return any(s.frame_window == "random" for s in self._sets)

    # ------------------------------------------------------------------ items, skipping, split
    def prepare_data(self) -> None:
        # runs once per node: fill the cache here when this module builds its own VAE
        if self.latents_cache is not None and self.vae is not None:
            os.makedirs(self.latents_cache, exist_ok=True)
            self._scan()
            model = presets.build_model(self.vae.arch, self.vae.pretrained, self.vae.subfolder, self.vae.preset,
                                        {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.vae.dtype])
            device = self.encode_device or ("cuda" if torch.cuda.is_available() else "cpu")
            self.fill_cache(freeze(model).to(device))

    def setup(self, stage: str) -> None:
        self._scan()

    def _probe_level(self, s: _Settings) -> str:
        """How far setup opens each file: decode (check_files, no cache: the fill decodes), the header (the
        run needs sizes or lengths), or nothing."""
        if self.check_files and self.latents_cache is None:
            return "decode"
        needs_info = s.sizes is not None or s.frame_window != "first" or s.target_fps is not None
        return "header" if self.check_files or needs_info else "none"

    def _scan(self) -> None:
        if self.train_entries is not None:
            return
        entries, skipped, seen = [], [], 0
        for i, s in enumerate(self._sets):
            listed = read_metadata(s.base, s.metadata) if s.metadata is not None else list_items(s.root)
            level = self._probe_level(s)
            longest = max(s.frame_buckets or (s.frames,))
            limit = None if s.frame_window != "first" else (
                lambda fps, s=s, longest=longest: _span(longest, fps / s.target_fps if s.target_fps and fps
                                                        else s.frame_stride))
            for path, caption in listed:
                seen += 1
                try:
                    entries.append(plan(path, caption, probe(path, level, limit), s, i))
                except Unusable as err:
                    if self.strict:
                        raise ValueError(f"{path}: {err}") from err.__cause__
                    skipped.append((path, str(err), err.kind))
        self._skip(skipped, seen, entries, "")
        train, val = self._split(entries)
        self.train_entries, self.val_entries = train, val
        samples = sum(e.repeats for e in train)
        repeats = f" ({samples} samples per epoch with repeats)" if samples != len(train) else ""
        rank_zero_info(f"VideoFolder: {len(train)} train / {len(val)} validation items{repeats}")

    def _skip(self, skipped: list[tuple[str, str, str]], seen: int, kept: list, when: str) -> None:
        """Say once what was skipped (how many, why, the first few paths); nothing left is an error."""
        self.skipped += [(path, why) for path, why, _ in skipped]
        if not skipped:
            return
        kinds: dict[str, int] = {}
        for _, _, kind in skipped:
            kinds[kind] = kinds.get(kind, 0) + 1
        shown = "\n".join(f"  {path}: {why}" for path, why, _ in skipped[:5])
        more = f"\n  … and {len(skipped) - 5} more" if len(skipped) > 5 else ""
        counts = ", ".join(f"{kind}: {n}" for kind, n in sorted(kinds.items()))
        if not kept:
            raise ValueError(f"VideoFolder: no usable file: all {seen} of {self._where()} were skipped{when} "
                             f"({counts}):\n{shown}{more}")
        rank_zero_warn(f"VideoFolder: skipped {len(skipped)} of {seen} files{when} ({counts}):\n{shown}{more}\n"
                       f"(`strict: true` stops at the first instead)")

    def _where(self) -> str:
        return " and ".join(s.where() for s in self._sets)

    def _relative(self, entry: Entry) -> str:
        return os.path.normpath(os.path.relpath(entry.path, self._sets[entry.dataset].base))

    def _split(self, entries: list[Entry]) -> tuple[list[Entry], list[Entry]]:
        if self.val_files:
            wanted = {os.path.normpath(f) for f in self.val_files}
            names = [{self._relative(e), os.path.normpath(os.path.abspath(e.path))} for e in entries]
            if unknown := sorted(wanted - set().union(*names)):
                raise ValueError(f"VideoFolder: val_files not in {self._where()}: {unknown}")
            val = [e for e, n in zip(entries, names) if n & wanted]
            train = [e for e, n in zip(entries, names) if not n & wanted]
            if not train:
                raise ValueError(f"VideoFolder: the validation split takes all {len(entries)} items of "
                                 f"{self._where()}; lower val_fraction or list fewer val_files")
            return train, val
        if self.val_fraction <= 0:
            return entries, []
        if len(entries) == 1:
            rank_zero_info(f"VideoFolder: val_fraction={self.val_fraction} of one item would leave nothing to train "
                           f"on: no validation")
            return entries, []
        n_val = min(max(1, round(self.val_fraction * len(entries))), len(entries) - 1)
        order = torch.randperm(len(entries), generator=torch.Generator().manual_seed(self.seed)).tolist()
        held = set(order[:n_val])
        return ([e for i, e in enumerate(entries) if i not in held], [e for i, e in enumerate(entries) if i in held])

    # ------------------------------------------------------------------ buckets
    def bucket_table(self, num_replicas: int = 1) -> list[tuple[tuple[int, int, int], int, int]]:
        """(bucket (frames, height, width), samples, batches per epoch) of the training set, by bucket."""
        self._scan()
        counts: dict[tuple[int, int, int], int] = {}
        for entry in self.train_entries:
            counts[entry.bucket] = counts.get(entry.bucket, 0) + entry.repeats
        per_step = self.batch_size * num_replicas
        return [(bucket, n, -(-n // per_step)) for bucket, n in sorted(counts.items())]

    def describe_buckets(self, num_replicas: int = 1) -> str:
        rows = self.bucket_table(num_replicas)
        lines = [f"VideoFolder buckets (frames x height x width: samples, batches per epoch of up to "
                 f"{self.batch_size} per process, {num_replicas} process{'es' if num_replicas > 1 else ''}):"]
        lines += [f"  {f:>4} x {h:>4} x {w:<4}  {n:>6} samples  {b:>5} batches" for (f, h, w), n, b in rows]
        lines.append(f"  {'all':<18}  {sum(n for _, n, _ in rows):>6} samples  {sum(b for *_, b in rows):>5} batches")
        return "\n".join(lines)

    # ------------------------------------------------------------------ latents cache
    def cache_key(self, entry: Entry, vae_id: str) -> str:
        params = {"format": CACHE_FORMAT, "file": file_hash(entry.path), "frames": entry.frames,
                  "height": entry.height, "width": entry.width, "frame_stride": entry.frame_stride,
                  "repeat_images": entry.repeat_images, "vae": vae_id}
        if entry.window != "first":  # options that change the frames; absent at their defaults (the same keys)
            params["frame_window"] = entry.window
        if entry.target_fps is not None:
            params["target_fps"] = entry.target_fps
        return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:32]

    def fill_cache(self, vae: torch.nn.Module, rank: int = 0, processes: int = 1, record: bool = True) -> int:
        """Encode every entry without a cache entry for this VAE and size, ``rank`` of ``processes`` taking every
        ``processes``-th of them; returns how many this process encoded. ``record``: then take every entry's file
        (all processes done), dropping those no process could encode."""
        self._scan()
        entries = self.train_entries + self.val_entries
        for f, h, w in sorted({e.bucket for e in entries}):
            vae_codec.latent_shape(vae, f, h, w)  # e.g. Wan: frames = 4k+1, H, W % 8
        os.makedirs(self.latents_cache, exist_ok=True)
        vae_id = weights_hash(vae)
        device = next(vae.parameters()).device
        targets = {e: os.path.join(self.latents_cache, self.cache_key(e, vae_id) + ".safetensors") for e in entries}
        mine = [e for i, e in enumerate(entries) if i % processes == rank
                and not os.path.isfile(targets[e]) and not os.path.isfile(targets[e] + SKIP_MARK)]
        if mine:
            rank_zero_info(f"VideoFolder: encoding {len(mine)} items into the latents cache {self.latents_cache!r}"
                           + (f" (this process's share of {processes})" if processes > 1 else ""))
        encoded, every = 0, max(1, -(-len(mine) // 10))  # a progress line every tenth
        for entry in mine:
            try:
                video = FolderDataset([entry], seed=self.seed).video(0)
            except ValueError as err:
                if self.strict:
                    raise
                _write_atomic(targets[entry] + SKIP_MARK, str(err).replace(f"{entry.path}: ", "", 1))
                continue
            latents = vae_codec.encode(vae, video[None].to(device))[0].cpu().contiguous()
            tmp = f"{targets[entry]}.{os.getpid()}.tmp"  # atomic: another process may write the same entry
            save_file({"latents": latents}, tmp, metadata={"file": os.path.relpath(entry.path, self._sets[
                entry.dataset].base)})
            os.replace(tmp, targets[entry])
            encoded += 1
            if encoded % every == 0 or encoded == len(mine):
                rank_zero_info(f"VideoFolder: latents cache {encoded}/{len(mine)}")
        if record:
            self._record_cache(targets)
        return encoded

    def _record_cache(self, targets: dict[Entry, str]) -> None:
        """Take each entry's cache file; entries marked unusable by the fill are dropped, said once."""
        bad = []
        for entry, target in targets.items():
            if os.path.isfile(target):
                self._latents[entry] = target
            elif os.path.isfile(target + SKIP_MARK):
                with open(target + SKIP_MARK, encoding="utf-8") as f:
                    bad.append((entry.path, f.read().strip(), "unreadable"))
            else:
                raise FileNotFoundError(f"VideoFolder: latents cache entry {target!r} of {entry.path!r} was not "
                                        f"written; a process stopped while filling the cache: start the run again")
        if bad:
            paths = {path for path, _, _ in bad}
            self.train_entries = [e for e in self.train_entries if e.path not in paths]
            self.val_entries = [e for e in self.val_entries if e.path not in paths]
            self._skip(bad, len(targets), self.train_entries, " while encoding the latents cache")

    def _cache_ready(self) -> None:
        """Make sure every item has its cache entry before a loader reads them."""
        if self.latents_cache is None:
            return
        self._scan()
        if all(e in self._latents for e in self.train_entries + self.val_entries):
            return
        if self.vae is not None:
            self.prepare_data()  # without a trainer (or on another node's rank): fills only what is missing
            return
        trainer = self.trainer
        model = getattr(trainer, "lightning_module", None) if trainer is not None else None
        card = getattr(model, "card", None)
        if card is None or not card.built or not card.has("vae"):
            raise ValueError("VideoFolder: latents_cache needs a VAE; set `vae:` (an Expert with `pretrained`) "
                             "or train a model whose card has a built `vae`")
        # every process of a node encodes its share, then each takes all the entries
        self.fill_cache(card["vae"], rank=trainer.local_rank, processes=max(1, trainer.num_devices), record=False)
        trainer.strategy.barrier("VideoFolder.latents_cache")
        self.fill_cache(card["vae"])  # all entries exist now: only records their paths

    def _dataset(self, split: str) -> FolderDataset:
        if split not in self._datasets:
            self._cache_ready()
            entries = self.train_entries if split == "train" else self.val_entries
            latents = [self._latents[e] for e in entries] if self.latents_cache is not None else None
            self._datasets[split] = FolderDataset(entries, latents, seed=self.seed)
        return self._datasets[split]

    # ------------------------------------------------------------------ loaders
    def train_dataset(self) -> FolderDataset:
        self._scan()
        return self._dataset("train")

    def train_dataloader(self) -> DataLoader:
        if not self.buckets:
            return super().train_dataloader()
        dataset = self.train_dataset()
        ranks = self.data_parallel_ranks()
        sampler = BucketSampler(dataset.buckets(), self.batch_size, shuffle=True, seed=self.seed, **ranks)
        rank_zero_info(self.describe_buckets(sampler.num_replicas))
        return BucketLoader(dataset, sampler, collate_fn=self.collate, seed=self.seed, num_workers=self.num_workers,
                            persistent_workers=self.num_workers > 0, pin_memory=self.pin_memory())

    def val_dataloader(self) -> list | DataLoader:
        self._scan()
        if not self.val_entries:
            return []  # no split asked for: Lightning skips validation
        dataset = self._dataset("val")
        if not self.buckets:
            return DataLoader(dataset, batch_size=min(self.batch_size, len(dataset)), num_workers=self.num_workers)
        sampler = BucketSampler(dataset.buckets(), self.batch_size, shuffle=False, seed=self.seed,
                                **self.data_parallel_ranks())
        return DataLoader(Batched(dataset), batch_size=None, sampler=sampler, collate_fn=self.collate,
                          num_workers=self.num_workers)

    def sample_prompts(self, k: int) -> list[str]:
        """The first ``k`` held-out captions, or the first ``k`` training captions without a validation split."""
        self._scan()
        return [caption for _, caption in (self.val_items or self.train_items)[:k]]

    def predict_dataloader(self) -> DataLoader:
        """The held-out captions (or the first ``batch_size`` training captions) as prompts."""
        self._scan()
        items = self.val_items or self.train_items[: self.batch_size]
        return DataLoader([batch_schema.item(caption, i) for i, (_, caption) in enumerate(items)],
                          batch_size=self.batch_size)


def _resolve(top: _Settings, fs: FolderSet, where: str, latents_cache: Optional[str]) -> tuple[_Settings, list[str]]:
    """The settings of one dataset: the top-level ones with its own on top (shared frame buckets cut at its own
    frames), and their problems under its name (``where``: ``datasets[i].``, empty for a lone ``root``)."""
    own = {k: getattr(fs, k) for k in OWN_SETTINGS if getattr(fs, k) is not None}
    if "frame_buckets" in own:
        own["frame_buckets"] = tuple(own["frame_buckets"])
    elif "frames" in own and top.frame_buckets is not None:
        own["frame_buckets"] = tuple(sorted({f for f in top.frame_buckets if f <= own["frames"]} | {own["frames"]}))
    s = replace(top, **own, root=fs.root, metadata=fs.metadata, repeats=fs.repeats, caption_prefix=fs.caption_prefix)
    if not where:
        return s, []
    problems = []
    if own and min(s.frames, s.height, s.width) < 1:
        problems.append(f"{where}frames, height, width = {s.frames}, {s.height}, {s.width} must be >= 1")
    if own:  # what the top-level options alone get wrong is said once, without a dataset's name
        top_problems = _setting_problems(top, "", latents_cache)
        problems += [p for p in _setting_problems(s, where, latents_cache)
                     if p.replace(where, "", 1) not in top_problems]
    if fs.root is None and fs.metadata is None:
        problems.append(f"{where[:-1]}: give `root` (a folder) or `metadata` (a .jsonl or .csv file)")
    if not isinstance(fs.repeats, int) or fs.repeats < 1:
        problems.append(f"{where}repeats={fs.repeats} must be an integer >= 1")
    return s, problems


def _setting_problems(s: _Settings, where: str, latents_cache: Optional[str]) -> list[str]:
    """The problems of one set's resolved settings (``where`` prefixes the option names of a ``datasets`` entry)."""
    problems = []
    if s.frame_stride < 1:
        problems.append(f"{where}frame_stride={s.frame_stride} must be >= 1")
    if s.frame_window not in ("first", "random", "uniform"):
        problems.append(f"{where}frame_window={s.frame_window!r} must be 'first', 'random' or 'uniform'")
    if s.target_fps is not None and s.target_fps <= 0:
        problems.append(f"{where}target_fps={s.target_fps} must be > 0 (frames per second; null keeps the source's)")
    if s.target_fps is not None and s.frame_stride != 1:
        problems.append(f"{where}give `target_fps` or `frame_stride`, not both (target_fps resamples the clip)")
    if s.frame_window == "uniform" and (s.frame_stride != 1 or s.target_fps is not None):
        problems.append(f"{where}frame_window='uniform' spreads the frames over the whole clip: drop "
                        f"frame_stride / target_fps, or use 'first' or 'random'")
    if s.frame_window == "random" and latents_cache is not None:
        problems.append(f"{where}frame_window='random' reads other frames each epoch, but a latents_cache encodes "
                        f"each item once: use 'first' or 'uniform', or set `latents_cache: null`")
    if s.frame_buckets is not None and (not s.frame_buckets or any(f < 1 or f > s.frames for f in s.frame_buckets)):
        problems.append(f"{where}frame_buckets={list(s.frame_buckets)} must be frame counts from 1 to "
                        f"frames={s.frames}")
    return problems


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
