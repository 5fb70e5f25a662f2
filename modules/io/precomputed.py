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

and ``manifest.json``: the shards with their SHA-256 and row counts, the video size and text length, and the
SHA-256 of the weights of every expert the rows came from. Loading verifies every shard's hash before reading
it (safetensors: no pickle), and a training run refuses rows made by other weights or at another size.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from posttrain.modules.models.cache import file_hash

FORMAT = 1
MANIFEST = "manifest.json"


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


def mismatches(manifest: dict[str, Any], digests: dict[str, str], text_max_length: int,
               video: Optional[tuple[int, int, int]]) -> list[str]:
    """How the rows' sources differ from a run's experts (``digests``: expert -> weights SHA-256)."""
    problems = []
    for name, digest in manifest["sources"].items():
        if name not in digests:
            problems.append(f"the rows come from expert {name!r}, which this card does not have")
        elif digests[name] != digest:
            problems.append(f"expert {name!r} has other weights than the ones the rows were made with")
    if manifest["text_max_length"] != text_max_length:
        problems.append(f"text_max_length {text_max_length} (rows: {manifest['text_max_length']})")
    if video is not None and manifest.get("video") is not None and tuple(manifest["video"]) != tuple(video):
        problems.append(f"video size (frames, height, width) {tuple(video)} (rows: {tuple(manifest['video'])})")
    return problems
