"""A folder of real captioned videos and images, optionally encoded once into a latents cache on disk.

Two layouts of ``root`` (searched recursively):

* media files with a caption file of the same stem: ``clip.mp4`` + ``clip.txt``, ``cat.png`` + ``cat.txt``;
* a ``metadata.jsonl`` with one ``{"file": "clips/a.mp4", "caption": "..."}`` per line, paths relative
  to ``root``. When it exists it alone lists the data; ``.txt`` files are then not read.

Every item becomes a ``(3, frames, height, width)`` video in [-1, 1]: the clip's first ``frames``
frames taken every ``frame_stride`` source frames, resized so that it covers (height, width) and
center-cropped. A still image is a 1-frame video; with ``frames > 1`` it is an error unless
``repeat_images`` makes it a still clip of ``frames`` copies. Nothing is padded or trimmed silently:
a clip shorter than ``(frames - 1) * frame_stride + 1`` source frames is an error naming it.

With ``latents_cache`` set, each item is encoded once with the frozen VAE (distribution mode, as
``modules.vae.encode``) into ``<latents_cache>/<key>.safetensors``, where ``key`` hashes the file's
bytes, the size options and the VAE's weights. Batches then carry ``"latents"`` (B, z, F', h, w)
instead of ``"video"``, and ``posttrain.lit.finetune.Finetune`` skips its own VAE pass. Changing the size
options or the VAE changes every key, so a stale entry is never read (it stays on disk, unused).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, Dataset

from posttrain.datamodules.sampling import ResumableDataModule
from posttrain.modules.io import batch as batch_schema
from posttrain.modules.models import presets
from posttrain.modules.models import vae as vae_codec
from posttrain.modules.models.cache import file_hash
from posttrain.modules.models.cards import Expert, freeze

VIDEO_EXTS = (".mp4", ".mov", ".webm", ".mkv", ".gif")
IMAGE_EXTS = (".png", ".jpg", ".jpeg")
METADATA = "metadata.jsonl"
METADATA_LINE = ('each line is one JSON object, keys and strings in double quotes, the path relative to the folder: '
                 '{"file": "clips/a.mp4", "caption": "a red circle moving left"}')
CACHE_FORMAT = 1  # bump when the stored latents change meaning


# ---------------------------------------------------------------------- listing and captions
def _is_media(name: str) -> bool:
    return name.lower().endswith(VIDEO_EXTS + IMAGE_EXTS)


def list_items(root: str) -> list[tuple[str, str]]:
    """(media path, caption) pairs of ``root``, sorted by path; errors name the file (and line)."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"VideoFolder: data folder {root!r} does not exist")
    metadata = os.path.join(root, METADATA)
    if os.path.isfile(metadata):
        return _read_metadata(root, metadata)
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


def _read_metadata(root: str, metadata: str) -> list[tuple[str, str]]:
    items = []
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
            if not record["caption"].strip():
                raise ValueError(f"{metadata}:{lineno}: empty caption for {record['file']!r}")
            path = os.path.join(root, record["file"])
            if not _is_media(path):
                raise ValueError(f"{metadata}:{lineno}: {record['file']!r} is not a supported media file "
                                 f"({', '.join(VIDEO_EXTS + IMAGE_EXTS)})")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{metadata}:{lineno}: file {record['file']!r} does not exist "
                                        f"(looked for {path})")
            items.append((path, record["caption"].strip()))
    if not items:
        raise ValueError(f"{metadata}: holds no entries")
    return items


# ---------------------------------------------------------------------- decoding
def read_frames(path: str, frames: int, frame_stride: int = 1, repeat_images: bool = False) -> np.ndarray:
    """(frames, H, W, 3) uint8: source frames 0, s, 2s, … of a clip, or an image as 1 (or repeated) frame."""
    needed = (frames - 1) * frame_stride + 1
    is_image = path.lower().endswith(IMAGE_EXTS)
    if is_image and frames > 1 and not repeat_images:
        raise ValueError(f"{path}: an image is a 1-frame video but frames={frames}; "
                         f"set `frames: 1`, or `repeat_images: true` for a still clip")
    try:
        source = _decode(path, 1 if is_image else needed)
    except Exception as err:  # decoders raise OSError, RuntimeError, ValueError…: name the file and the fix
        fix = (IMAGE_FIX if is_image else VIDEO_FIX).format(name=os.path.basename(path))
        raise ValueError(f"{path}: cannot read this media file ({_decoder_problem(path, err)}); {fix}") from err
    if is_image:
        return np.repeat(source[:1], frames, axis=0)
    if len(source) < needed:
        raise ValueError(f"{path}: has {len(source)} frames; frames={frames} with frame_stride={frame_stride} "
                         f"needs {needed}")
    return np.stack(source[::frame_stride])


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
    """Items of a folder in the batch schema (``modules/io/batch.py``), with ``video`` or ``latents``."""

    def __init__(self, items: list[tuple[str, str]], frames: int, height: int, width: int, frame_stride: int,
                 repeat_images: bool, latents: Optional[list[str]] = None):
        self.items, self.latents = items, latents
        self.frames, self.height, self.width = frames, height, width
        self.frame_stride, self.repeat_images = frame_stride, repeat_images

    def __len__(self) -> int:
        return len(self.items)

    def video(self, index: int) -> torch.Tensor:
        frames = read_frames(self.items[index][0], self.frames, self.frame_stride, self.repeat_images)
        return to_video(frames, self.height, self.width)

    def __getitem__(self, index: int) -> dict:
        prompt = self.items[index][1]
        if self.latents is not None:
            return batch_schema.item(prompt, index, latents=load_file(self.latents[index])["latents"])
        return batch_schema.item(prompt, index, video=self.video(index))


# ---------------------------------------------------------------------- datamodule
class VideoFolder(ResumableDataModule):
    """Captioned real videos/images from a folder (``.txt`` beside each file, or a ``metadata.jsonl``).

    Args:
        root: the data folder.
        frames: frames per sample (Wan VAE: 4k+1; 1 for images).
        height, width: output size in pixels; each item is resized to cover it and center-cropped. The
            ``posttrain`` command sets frames, height and width from ``model.init_args.run``.
        frame_stride: take every ``frame_stride``-th source frame, from the clip's first.
        repeat_images: with ``frames > 1``, make an image a still clip instead of rejecting it.
        latents_cache: folder of precomputed VAE latents; batches then carry ``latents``, not ``video``.
        vae: the VAE that fills the cache in ``prepare_data``, loaded here from its ``pretrained`` folder.
            None: the ``vae`` expert of the model's card, used when the first dataloader is built.
        encode_device: device of the cache encoding with ``vae``; None = cuda when available.
        val_fraction: share of items held out for validation (seeded by ``seed``).
        val_files: held-out items by path relative to ``root`` (instead of ``val_fraction``).
        check_files: decode every item at setup, so a bad file stops the run before training (with a
            ``latents_cache``, filling the cache does this for every file not yet encoded).
        batch_size, num_workers, seed: loader settings; ``seed`` fixes the order and the split.
    """

    def __init__(self, root: str, frames: int = 9, height: int = 32, width: int = 32, frame_stride: int = 1,
                 repeat_images: bool = False, latents_cache: Optional[str] = None, vae: Optional[Expert] = None,
                 encode_device: Optional[str] = None, val_fraction: float = 0.0,
                 val_files: Optional[list[str]] = None, check_files: bool = True, batch_size: int = 4,
                 num_workers: int = 0, seed: int = 0):
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        problems = []
        if frames < 1 or height < 1 or width < 1:
            problems.append(f"frames, height, width = {frames}, {height}, {width} must be >= 1")
        if frame_stride < 1:
            problems.append(f"frame_stride={frame_stride} must be >= 1")
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
        if problems:
            raise ValueError("VideoFolder:\n  - " + "\n  - ".join(problems))
        self.root, self.frames, self.height, self.width = root, frames, height, width
        self.frame_stride, self.repeat_images = frame_stride, repeat_images
        self.latents_cache, self.vae, self.encode_device = latents_cache, vae, encode_device
        self.val_fraction, self.val_files, self.check_files = val_fraction, val_files, check_files
        self.train_items: Optional[list[tuple[str, str]]] = None
        self.val_items: list[tuple[str, str]] = []
        self._latents: dict[str, str] = {}  # media path -> cache file, once encoded
        self._datasets: dict[str, FolderDataset] = {}

    # ------------------------------------------------------------------ items, split, checks
    def prepare_data(self) -> None:
        # runs once per node: fill the cache here when this module builds its own VAE
        if self.latents_cache is not None and self.vae is not None:
            self._scan()
            model = presets.build_model(self.vae.arch, self.vae.pretrained, self.vae.subfolder, self.vae.preset,
                                        {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.vae.dtype])
            device = self.encode_device or ("cuda" if torch.cuda.is_available() else "cpu")
            self.fill_cache(freeze(model).to(device))

    def setup(self, stage: str) -> None:
        self._scan()

    def _scan(self) -> None:
        if self.train_items is not None:
            return
        items = list_items(self.root)
        # with a cache, filling it decodes each new file (same errors) and a hit was read before
        if self.check_files and self.latents_cache is None:
            for path, _ in items:  # raises naming the file: unreadable, too short, image with frames > 1
                read_frames(path, self.frames, self.frame_stride, self.repeat_images)
        self.train_items, self.val_items = self._split(items)

    def _split(self, items: list[tuple[str, str]]) -> tuple[list, list]:
        if self.val_files:
            wanted = {os.path.normpath(f) for f in self.val_files}
            rel = [os.path.normpath(os.path.relpath(p, self.root)) for p, _ in items]
            if unknown := sorted(wanted - set(rel)):
                raise ValueError(f"VideoFolder: val_files not in {self.root!r}: {unknown}")
            val = [item for item, r in zip(items, rel) if r in wanted]
            train = [item for item, r in zip(items, rel) if r not in wanted]
        elif self.val_fraction > 0:
            n_val = max(1, round(self.val_fraction * len(items)))
            order = torch.randperm(len(items), generator=torch.Generator().manual_seed(self.seed)).tolist()
            held = set(order[:n_val])
            val = [item for i, item in enumerate(items) if i in held]
            train = [item for i, item in enumerate(items) if i not in held]
        else:
            return items, []
        if not train:
            raise ValueError(f"VideoFolder: the validation split takes all {len(items)} items of {self.root!r}; "
                             f"lower val_fraction or list fewer val_files")
        return train, val

    # ------------------------------------------------------------------ latents cache
    def cache_key(self, path: str, vae_id: str) -> str:
        params = {"format": CACHE_FORMAT, "file": file_hash(path), "frames": self.frames, "height": self.height,
                  "width": self.width, "frame_stride": self.frame_stride, "repeat_images": self.repeat_images,
                  "vae": vae_id}
        return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:32]

    def fill_cache(self, vae: torch.nn.Module) -> int:
        """Encode every item without a cache entry for this VAE and size; returns how many were encoded."""
        self._scan()
        vae_codec.latent_shape(vae, self.frames, self.height, self.width)  # e.g. Wan: frames = 4k+1, H, W % 8
        os.makedirs(self.latents_cache, exist_ok=True)
        vae_id = weights_hash(vae)
        device = next(vae.parameters()).device
        encoded = 0
        for path, _ in self.train_items + self.val_items:
            target = os.path.join(self.latents_cache, self.cache_key(path, vae_id) + ".safetensors")
            if not os.path.isfile(target):
                video = FolderDataset([(path, "")], self.frames, self.height, self.width, self.frame_stride,
                                      self.repeat_images).video(0)
                latents = vae_codec.encode(vae, video[None].to(device))[0].cpu().contiguous()
                tmp = f"{target}.{os.getpid()}.tmp"  # atomic: another process may write the same entry
                save_file({"latents": latents}, tmp, metadata={"file": os.path.relpath(path, self.root)})
                os.replace(tmp, target)
                encoded += 1
            self._latents[path] = target
        return encoded

    def _cache_ready(self) -> None:
        """Make sure every item has its cache entry before a loader reads them."""
        if self.latents_cache is None:
            return
        self._scan()
        if all(path in self._latents for path, _ in self.train_items + self.val_items):
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
        if trainer.local_rank == 0:
            self.fill_cache(card["vae"])
        trainer.strategy.barrier("VideoFolder.latents_cache")
        if trainer.local_rank != 0:
            self.fill_cache(card["vae"])  # all entries exist now: only records their paths

    def _dataset(self, split: str) -> FolderDataset:
        if split not in self._datasets:
            self._cache_ready()
            items = self.train_items if split == "train" else self.val_items
            latents = [self._latents[p] for p, _ in items] if self.latents_cache is not None else None
            self._datasets[split] = FolderDataset(items, self.frames, self.height, self.width, self.frame_stride,
                                                  self.repeat_images, latents)
        return self._datasets[split]

    # ------------------------------------------------------------------ loaders
    def train_dataset(self) -> Dataset:
        self._scan()
        return self._dataset("train")

    def val_dataloader(self) -> list | DataLoader:
        self._scan()
        if not self.val_items:
            return []  # no split asked for: Lightning skips validation
        return DataLoader(self._dataset("val"), batch_size=min(self.batch_size, len(self.val_items)),
                          num_workers=self.num_workers)

    def predict_dataloader(self) -> DataLoader:
        """The held-out captions (or the first ``batch_size`` training captions) as prompts."""
        self._scan()
        items = self.val_items or self.train_items[: self.batch_size]
        return DataLoader([batch_schema.item(caption, i) for i, (_, caption) in enumerate(items)],
                          batch_size=self.batch_size)
