"""Precomputed training inputs on disk: VAE latents and frozen text-encoder rows of a dataset, encoded once.

A folder written by ``posttrain preprocess`` (``lit/tools/preprocess.py``) holds, per split (``train``, ``val``),
one safetensors shard per encoding process with

- ``index`` (n,) int64: the dataset indices of the rows (the shards of a split cover ``range(count)``),
- ``latents`` (n, C, F', h, w): the VAE's normalized latents, float32, exactly what training would compute
  (absent for a prompt-only dataset),
- ``text/<encoder>`` (n, ...): each frozen text encoder's row of the sample's prompt, in that encoder's dtype
  (bfloat16 for a bf16 encoder: what the in-memory cache would hold), and ``empty/<encoder>`` (1, ...): the
  empty prompt's (caption dropout, the unconditional branch of CFG),
- the prompts, in the shard's metadata,

and ``manifest.json``: the shards with their SHA-256 and row counts, the video size and text length, the
SHA-256 of the weights of every expert the rows came from (``sources``), the shard of the prompts the config's
callbacks sample beyond the data (``samples``, laid out as a split), and each expert's source (``origins``:
``source_record``, what a run compares when it does not load that expert). Loading verifies every shard's hash
before reading it (safetensors: no pickle), and a training run refuses rows made by other weights or at another
size.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from posttrain.modules.models import presets
from posttrain.modules.models.cache import file_hash

FORMAT = 1
MANIFEST = "manifest.json"
SAMPLES = "samples"  # the rows of the prompts a config's callbacks draw beyond the data (SampleVideos' own)


def shard_name(split: str, rank: int, processes: int) -> str:
    return f"{split}-{rank:05d}-of-{processes:05d}.safetensors"


def write_shard(path: str, index: torch.Tensor, prompts: list[str], latents: Optional[torch.Tensor],
                text: dict[str, torch.Tensor], empty: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One process's rows of one split; returns its manifest entry."""
    tensors = {"index": index.to(torch.int64).contiguous()}
    if latents is not None:
        tensors["latents"] = latents.contiguous()
    tensors.update({f"text/{name}": rows.contiguous() for name, rows in text.items()})
    tensors.update({f"empty/{name}": row.contiguous() for name, row in empty.items()})
    save_file(tensors, path, metadata={"prompts": json.dumps(prompts)})
    return {"file": os.path.basename(path), "rows": len(prompts), "sha256": file_hash(path)}


class PrecomputedSplit:
    """The rows of one split, verified and loaded: ``latents`` (N, ...) or None, ``prompts`` (N,),
    ``text`` {encoder: (N, ...)}, ``empty`` {encoder: (1, ...)}, in dataset-index order."""

    def __init__(self, folder: str, split: str, manifest: dict[str, Any]):
        entries = manifest["splits"].get(split)
        if entries is None:
            raise ValueError(f"precomputed data {folder!r} has no {split!r} split (it has "
                             f"{sorted(manifest['splits'])}); run `posttrain preprocess` again")
        parts: list[dict[str, torch.Tensor]] = []
        prompts: list[tuple[int, str]] = []
        for entry in entries["files"]:
            path = os.path.join(folder, entry["file"])
            if not os.path.isfile(path):
                raise FileNotFoundError(f"precomputed data {folder!r}: shard {entry['file']} is missing; run "
                                        f"`posttrain preprocess` again")
            if file_hash(path) != entry["sha256"]:
                raise ValueError(f"precomputed data {folder!r}: shard {entry['file']} does not match its SHA-256 "
                                 f"in {MANIFEST} (changed or damaged); run `posttrain preprocess` again")
            with safe_open(path, framework="pt") as f:
                part = {key: f.get_tensor(key) for key in f.keys()}
                names = json.loads(f.metadata()["prompts"])
            prompts += list(zip(part["index"].tolist(), names))
            parts.append(part)
        index = torch.cat([p["index"] for p in parts])
        order = torch.argsort(index)
        if not torch.equal(index[order], torch.arange(entries["count"])):
            raise ValueError(f"precomputed data {folder!r}: the {split} shards do not cover indices "
                             f"0..{entries['count'] - 1} once each; run `posttrain preprocess` again")
        join = lambda key: torch.cat([p[key] for p in parts])[order]  # noqa: E731
        self.latents = join("latents") if "latents" in parts[0] else None
        self.text = {key[len("text/"):]: join(key) for key in parts[0] if key.startswith("text/")}
        self.empty = {key[len("empty/"):]: parts[0][key] for key in parts[0] if key.startswith("empty/")}
        self.prompts = [name for _, name in sorted(prompts)]

    def __len__(self) -> int:
        return len(self.prompts)


def read_manifest(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder!r} holds no {MANIFEST}: it is not a folder written by `posttrain "
                                f"preprocess --config <your config> --out {folder}` (or that run did not finish)")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"precomputed data {folder!r} has format {manifest.get('format')!r}, this version reads "
                         f"{FORMAT}; run `posttrain preprocess` again")
    return manifest


# what an expert's weights are made of besides them: a source record of the same values builds the same weights
SOURCE_KEYS = ("arch", "pretrained", "subfolder", "published", "preset", "dtype", "fp8")


def source_record(spec: Any, recorded: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Where expert ``spec``'s (an ``Expert``) weights come from, without building it: its ``SOURCE_KEYS`` and
    ``weights``, which names the weights themselves: a published model's name and seed; for stored weights (a
    ``pretrained`` folder, a shipped asset) the SHA-256 of the bytes of its safetensors files and config.json
    (``files_record``); None for random preset weights (or weights not in safetensors), which only the built model
    names. ``recorded``: the record the rows keep, whose digest stands while every file keeps its size and time."""
    record = {key: getattr(spec, key) for key in SOURCE_KEYS}
    record["preset"] = dict(spec.preset)
    if spec.published is not None:
        from posttrain.modules.models import published

        record["weights"] = {"seed": published.seed_of(spec.published, spec.arch, spec.subfolder)}
    elif presets.loads_weights(spec.arch, spec.pretrained, spec.preset):
        folder = presets.weights_folder(spec.arch, spec.pretrained, spec.subfolder)
        record["weights"] = files_record(folder, (recorded or {}).get("weights"))
    else:
        record["weights"] = None
    return record


def files_record(folder: str, known: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
    """``{"folder", "files": {name: [bytes, mtime_ns]}, "sha256"}`` of a weights folder's safetensors files and
    config.json: SHA-256 streamed over their names and bytes, in name order (1 MiB at a time: reading the files
    takes no memory). Where ``known`` (an earlier record) names the same folder and every file still has its size
    and modification time, its digest stands unread (as git's index and make trust a file's stat); None for a folder
    without safetensors weights."""
    try:
        files = sorted(presets.weight_files(folder) + [os.path.join(folder, "config.json")])
    except ValueError:
        return None
    folder = os.path.abspath(folder)
    stats = {os.path.basename(path): [os.stat(path).st_size, os.stat(path).st_mtime_ns] for path in files
             if os.path.isfile(path)}
    if known is not None and known.get("folder") == folder and known.get("files") == stats:
        return known
    digest = hashlib.sha256()
    for name in sorted(stats):
        digest.update(f"{name}\0".encode())
        with open(os.path.join(folder, name), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return {"folder": folder, "files": stats, "sha256": digest.hexdigest()}


def source_problems(name: str, recorded: Optional[dict[str, Any]], spec: Any) -> list[str]:
    """How expert ``name`` (``spec``, not loaded) differs from the source the rows record (``recorded``): a source
    key, or weights of another digest or seed (a ``pretrained`` folder may move: its files' digest is compared)."""
    if recorded is None:
        return [f"the rows record no source of expert {name!r} (written before `posttrain preprocess` recorded "
                f"sources), and it is not loaded (precomputed) to compare its weights"]
    current = source_record(spec, recorded)
    problems = [f"expert {name!r} {key} {current[key]!r} (rows: {recorded.get(key)!r})" for key in SOURCE_KEYS
                if key != "pretrained" and current[key] != recorded.get(key)]
    have, want = current["weights"], recorded.get("weights")
    if have is None or want is None:
        problems.append(f"expert {name!r}: the rows or the card name no weights that can be checked without "
                        f"loading it (random preset weights, or weights not in safetensors); load it "
                        f"(--model.init_args.card.experts.{name}.precomputed false)")
    else:
        key = "seed" if "seed" in want else "sha256"  # a published build's seed, a folder's files digest
        if have.get(key) != want.get(key):
            where = spec.pretrained or (f"published {spec.published!r}" if spec.published else "the shipped asset")
            problems.append(f"expert {name!r} has other weights than the ones the rows were made with ({where}: "
                            f"{key} {have.get(key)} vs rows {want.get(key)})")
    return problems


def mismatches(manifest: dict[str, Any], digests: dict[str, str], text_max_length: int,
               video: Optional[tuple[int, int, int]], unloaded: Optional[dict[str, Any]] = None) -> list[str]:
    """How the rows' sources differ from a run's experts (``digests``: expert -> weights SHA-256; ``unloaded``:
    expert -> ``Expert`` of those not loaded, compared by their source: ``source_problems``)."""
    problems = []
    unloaded = unloaded or {}
    for name, digest in manifest["sources"].items():
        if name in unloaded:
            problems += source_problems(name, (manifest.get("origins") or {}).get(name), unloaded[name])
        elif name not in digests:
            problems.append(f"the rows come from expert {name!r}, which this card does not have")
        elif digests[name] != digest:
            problems.append(f"expert {name!r} has other weights than the ones the rows were made with")
    if manifest["text_max_length"] != text_max_length:
        problems.append(f"text_max_length {text_max_length} (rows: {manifest['text_max_length']})")
    if video is not None and manifest.get("video") is not None and tuple(manifest["video"]) != tuple(video):
        problems.append(f"video size (frames, height, width) {tuple(video)} (rows: {tuple(manifest['video'])})")
    return problems
