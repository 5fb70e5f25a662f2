"""``posttrain preprocess``: encode a config's dataset once — VAE latents and frozen text-encoder rows — to disk.

    posttrain preprocess --config configs/finetune.yaml --out runs/precomputed [--processes 2]
    posttrain fit --config configs/finetune.yaml --data PrecomputedVideos --data.path runs/precomputed

Every process encodes the indices ``rank, rank + N, …`` of each split (``train``, and ``val`` when the
datamodule has one) in batches of the datamodule's batch size, through the card's own VAE and text encoders
(the same calls training makes, so training on the rows is bitwise training on the fly), and writes one
shard; the folder appears whole (written beside it, renamed at the end) with a manifest of SHA-256s, the
source experts' weight digests and their sources (``origins``: the digest of a weights folder's files, a published
seed), which a run compares for an encoder it does not load (``modules/io/precomputed.py``). On GPUs process ``r``
uses ``cuda:r``.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch

from posttrain.lit.tools.config import instantiate_part, parse
from posttrain.modules.io import precomputed


def preprocess(config: str, out: str, processes: int = 1, batch_size: Optional[int] = None,
               overwrite: bool = False) -> str:
    """Precompute the VAE latents and frozen text-encoder rows of ``config``'s dataset into ``out``.

    Args:
        config: a fit config (its card and its ``data:``).
        out: the folder to write (refused when it exists and is not empty, unless ``overwrite``).
        processes: encoding processes (one shard each per split).
        batch_size: rows per encoder call; None = the datamodule's batch size.
        overwrite: replace a non-empty ``out``.
    """
    if processes < 1:
        raise ValueError(f"preprocess: processes={processes} must be >= 1")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise FileExistsError(f"preprocess: {out!r} exists and is not empty; choose another --out or add "
                              f"--overwrite true")
    partial = f"{out.rstrip(os.sep)}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    try:
        if processes == 1:
            _work(0, 1, config, partial, batch_size)
        else:
            import torch.multiprocessing as mp

            mp.spawn(_work, args=(processes, config, partial, batch_size), nprocs=processes, join=True)
        parts = []
        for rank in range(processes):
            with open(os.path.join(partial, f"part-{rank}.json")) as f:
                parts.append(json.load(f))
            os.remove(os.path.join(partial, f"part-{rank}.json"))
        manifest = {"format": precomputed.FORMAT, "config": os.path.abspath(config), **parts[0]["about"],
                    "splits": {split: {"count": sum(p["splits"][split]["rows"] for p in parts),
                                       "files": [p["splits"][split] for p in parts]}
                               for split in parts[0]["splits"]}}
        with open(os.path.join(partial, precomputed.MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    counts = ", ".join(f"{split} {s['count']}" for split, s in manifest["splits"].items())
    drawn = manifest.get(precomputed.SAMPLES, {}).get("count")
    return f"wrote {out}: {counts} rows ({processes} process{'es' if processes > 1 else ''})" + (
        f", and those of the {drawn} prompts the callbacks sample" if drawn else "")


def _build(config: str):
    """The config's method (its card built on this process), datamodule and the prompts its callbacks draw beyond the
    data (``drawn_prompts``); no trainer, no logger."""
    cfg = parse(config, "preprocess")
    method = instantiate_part(cfg, "model", config, "preprocess")
    method.configure_model()
    data = instantiate_part(cfg, "data", config, "preprocess")
    return method, data, drawn_prompts(cfg, data, method.video)


def drawn_prompts(cfg, data, video) -> list[str]:
    """The prompts the config's callbacks sample (``drawn_prompts`` of ``SampleVideos``, ``Evaluate``): their rows let
    a run that does not load the text encoder sample them (``callbacks.precomputed``)."""
    import importlib

    drawn = []
    for callback in cfg.trainer.get("callbacks") or []:
        module, _, name = str(callback.get("class_path", "")).rpartition(".")
        cls = getattr(importlib.import_module(module or "posttrain.callbacks"), name, None)
        if cls is not None and hasattr(cls, "drawn_prompts"):
            args = callback.get("init_args")
            drawn += cls(**(args.as_dict() if args is not None else {})).drawn_prompts(data, video)
    return list(dict.fromkeys(p for p in drawn if p))


@torch.no_grad()
def _work(rank: int, processes: int, config: str, folder: str, batch_size: Optional[int]) -> None:
    if processes > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes))
    method, data, drawn = _build(config)
    card, stage = method.card, method.stage
    device = torch.device(f"cuda:{rank}") if torch.cuda.is_available() else torch.device("cpu")
    card.models.to(device)
    splits = {"train": data.train_dataset()}
    val = data.val_dataloader() if hasattr(data, "val_dataloader") else None
    if val is not None:
        splits["val"] = val.dataset
    batch_size = batch_size or getattr(data, "batch_size", 8)
    encoders = stage.encoders
    unloaded = [name for name in encoders if card.specs[name].precomputed]
    if unloaded:
        raise ValueError(f"preprocess: {unloaded} have precomputed: true, so they are not loaded and cannot encode the "
                         f"rows; drop `precomputed` from {config!r} (posttrain fit sets it when it reads the rows)")
    versions = {name: card.versions[name] for name in encoders}
    stage.adapter.text(stage, [""])
    empty = {name: card.cache.row(name, versions[name], "")[None].cpu() for name in encoders}

    def text_rows(prompts: list[str]) -> dict[str, torch.Tensor]:  # the training path: rows land in the card's cache
        stage.adapter.text(stage, prompts)
        return {name: torch.stack([card.cache.row(name, versions[name], p) for p in prompts]).cpu()
                for name in encoders}

    report = {"splits": {}}
    for split, dataset in splits.items():
        indices = list(range(rank, len(dataset), processes))
        prompts, latents, text = [], [], {name: [] for name in encoders}
        for start in range(0, len(indices), batch_size):
            items = [dataset[i] for i in indices[start:start + batch_size]]
            batch_prompts = [item["prompt"] for item in items]
            if "video" in items[0]:
                latents.append(stage.encode(torch.stack([item["video"] for item in items]).to(device)).cpu())
            for name, rows in text_rows(batch_prompts).items():
                text[name].append(rows)
            prompts += batch_prompts
        path = os.path.join(folder, precomputed.shard_name(split, rank, processes))
        report["splits"][split] = precomputed.write_shard(
            path, torch.tensor(indices, dtype=torch.int64), prompts, torch.cat(latents) if latents else None,
            {name: torch.cat(rows) for name, rows in text.items()}, empty)
    if rank == 0:
        sources = [stage.vae, *encoders] if "video" in splits["train"][0] else list(encoders)
        report["about"] = {"sources": {name: card.weights_digest(name) for name in sources},
                           "origins": {name: precomputed.source_record(card.specs[name]) for name in sources},
                           "text_max_length": card.text_max_length,
                           "video": [method.video.frames, method.video.height, method.video.width] if "video" in splits["train"][0] else None}
        if drawn:  # one shard of the callbacks' own prompts (SampleVideos), outside the splits
            rows = [text_rows(drawn[i:i + batch_size]) for i in range(0, len(drawn), batch_size)]
            entry = precomputed.write_shard(
                os.path.join(folder, precomputed.shard_name(precomputed.SAMPLES, 0, 1)),
                torch.arange(len(drawn)), drawn, None, {name: torch.cat([r[name] for r in rows]) for name in encoders},
                empty)
            report["about"][precomputed.SAMPLES] = {"count": len(drawn), "files": [entry]}
    with open(os.path.join(folder, f"part-{rank}.json"), "w") as f:
        json.dump(report, f)
