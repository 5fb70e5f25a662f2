"""Rows precomputed by ``posttrain preprocess`` (``datamodules.PrecomputedVideos``), handed to the method's card.

At the start of ``fit`` (and of ``validate``) the rows are checked against the run — the weights of the experts
that made them (for a text encoder not loaded, ``Expert.precomputed``, the source the rows record), the video size,
the text length — and the empty prompt's rows (caption dropout, CFG) go into the card's embedding cache. Before every
batch its ``text_embeds`` {encoder: rows} go into the cache too, where the method's conditioning finds them, so its
frozen text encoders never run on those prompts. For an encoder not loaded, the rows of the prompts the run draws
beyond the batches (a callback's ``drawn_prompts``: ``SampleVideos``, ``Evaluate``; ``posttrain preprocess`` encoded
them) are cached at the start too, and kept there with the empty prompt's for the whole run; a prompt of theirs the
rows lack stops the start. Every ``ExpertModule`` adds this callback (``configure_callbacks``); with any other
datamodule it does nothing.
"""
from __future__ import annotations

import torch
from lightning.pytorch import Callback

from posttrain.modules.io.precomputed import mismatches


class PrecomputedRows(Callback):
    def on_fit_start(self, trainer, pl_module) -> None:
        check_precomputed(trainer, pl_module)

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "validate":
            check_precomputed(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        take_precomputed(pl_module, batch)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx: int = 0) -> None:
        take_precomputed(pl_module, batch)


def check_precomputed(trainer, pl_module) -> None:
    """Refuse rows of a ``PrecomputedVideos`` datamodule made by other weights, size or text length, and cache its
    empty-prompt rows."""
    data = getattr(trainer, "datamodule", None)
    manifest = getattr(data, "manifest", None)
    if manifest is None:
        return
    card, video = pl_module.card, pl_module.video
    unloaded = {name: card.specs[name] for name in card.unloaded}
    digests = {name: card.weights_digest(name) for name in manifest["sources"] if card.has(name)
               and name not in unloaded}
    problems = mismatches(manifest, digests, card.text_max_length, (video.frames, video.height, video.width), unloaded)
    problems += [f"expert {name!r} is not loaded (precomputed: true), but the rows hold none of its rows (they hold "
                 f"{sorted(manifest['sources'])}); load it (--model.init_args.card.experts.{name}.precomputed false)"
                 for name in unloaded if name not in manifest["sources"]]
    if problems:
        raise ValueError(f"the precomputed rows in {data.path!r} do not fit this run: {'; '.join(problems)}. "
                         f"Run `posttrain preprocess --config <this config> --out {data.path} --overwrite true` "
                         f"again, or train on the original data")
    for name, rows in data.empty_text_embeds.items():
        card.cache.put(name, card.versions[name], [""], rows.to(_text_dtype(card, name)), pin=name in unloaded)
    if unloaded:
        cache_drawn_prompts(trainer, pl_module, data, list(unloaded))


def cache_drawn_prompts(trainer, pl_module, data, unloaded: list[str]) -> None:
    """Cache (pinned) the rows of the prompts the run draws beyond its batches — a callback's ``drawn_prompts``
    (``SampleVideos``, ``Evaluate``), or its ``prompts`` list — for the text encoders not loaded; a prompt the rows
    lack stops here, named, rather than at the first sample."""
    card = pl_module.card
    drawn: list[str] = []
    for callback in trainer.callbacks:
        if hasattr(callback, "drawn_prompts"):
            drawn += callback.drawn_prompts(data, pl_module.video)
        elif isinstance(getattr(callback, "prompts", None), list):
            drawn += [p for p in callback.prompts if isinstance(p, str)]
    drawn = list(dict.fromkeys(p for p in drawn if p))
    found, rows = data.text_rows(drawn)
    for name in unloaded:
        if name in rows:
            card.cache.put(name, card.versions[name], found, rows[name].to(_text_dtype(card, name)), pin=True)
    missing = [p for p in drawn if p not in set(found)]
    if missing:
        raise card.guards[unloaded[0]].error(missing)


def take_precomputed(pl_module, batch) -> None:
    """A batch's precomputed text rows go into the card's cache, where the conditioning finds them."""
    rows = batch.get("text_embeds") if isinstance(batch, dict) else None
    card = pl_module.card
    for name, values in (rows or {}).items():
        card.cache.put(name, card.versions[name], list(batch["prompt"]), values.to(_text_dtype(card, name)))


def _text_dtype(card, name: str) -> torch.dtype:
    return next(card[name].parameters()).dtype
