"""Frozen encoders kept in host memory (``ModelCard(offload_encoders=True)``), parked before the model goes to the
device, so they never take device memory between calls.

``offload_encoders(module)`` runs in ``ExpertModule.configure_model`` at the start of fit, after the card is built
and before the strategy moves the module to its device: the generator stage's frozen text encoders go to host memory
(``ModelCard.park``), and so does the VAE's encoder when every batch brings its latents (a ``latents_cache``,
``PrecomputedVideos``) and the generator reads no conditioning image. Then the prompts the run will condition on are
encoded into the card's cache, the text encoders on the device for that one pass: the data's (``prompt_list()`` of
``Prompts`` and ``SyntheticVideos``, the captions of ``VideoFolder``'s train and validation items), the prompts of
any callback that holds a list of them (``SampleVideos``) and the empty prompt (caption dropout, CFG). With
``PrecomputedVideos`` nothing is encoded: the rows come with the batches, and the encoders whose rows the folder
holds are not loaded at all (``Expert.precomputed``): there is nothing of them to park. A prompt not in the cache
later (more prompts than ``cache_size``, a prompt a refiner writes) brings a parked encoder to the device for that
call: correct, and slow by one copy of the encoder.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable, Optional, Sequence

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

ENCODE_BATCH = 8  # prompts per encoder call while filling the cache


def offload_encoders(module) -> None:
    """Park ``module.card``'s frozen encoders in host memory and cache the run's prompts (see the module docstring)."""
    trainer, card, stage = module.trainer, module.card, module.stage
    device = trainer.strategy.root_device
    data = getattr(trainer, "datamodule", None)
    precomputed = getattr(data, "manifest", None) is not None
    parked = card.offload_paths(stage, latents=precomputed or getattr(data, "latents_cache", None) is not None)
    for path in parked:
        card.park(path, device)
    # DDP neither broadcasts nor checks the device of what stays on the host (frozen: the same file on every rank)
    ddp_ignore(module, parked)
    prompts = [] if precomputed else run_prompts(data, trainer.callbacks)
    if prompts is None:
        rank_zero_warn("offload_encoders: the data does not list its prompts up front; each prompt not yet in the "
                       "cache brings the text encoder to the device for that call")
        prompts = [""]
    if len(prompts) > card.cache.max_entries:
        rank_zero_warn(f"offload_encoders: the run has {len(prompts)} prompts, the cache keeps "
                       f"{card.cache.max_entries} (card.cache_size); the others bring the text encoder to the device "
                       f"when they come")
        prompts = prompts[: card.cache.max_entries]
    with contextlib.ExitStack() as resident, torch.no_grad():
        for name in stage.encoders:
            if name in card.parked:
                resident.enter_context(card.parked[name].resident())
        for i in range(0, len(prompts), ENCODE_BATCH):
            stage.adapter.text(stage, prompts[i:i + ENCODE_BATCH])
    rank_zero_info(f"offload_encoders: {len(prompts)} prompts encoded; {', '.join(parked)} kept in host memory")


def ddp_ignore(module, paths: Sequence[str] = (), tensors: Iterable[Iterable[torch.Tensor]] = ()) -> None:
    """Leave the tensors of the card's modules at ``paths``, and the groups of ``tensors`` given, out of DDP's
    broadcast and device checks: frozen tensors that stay where they are (parked or swapped blocks in host memory;
    unloaded, on the meta device). ShardedExpertsStrategy adds its engines' tensors to the same list."""
    prefixes = tuple(f"card.models.{path}." for path in paths)
    ids = {id(t) for group in tensors for t in group}
    names = [n for n, t in [*module.named_parameters(), *module.named_buffers()]
             if (prefixes and n.startswith(prefixes)) or id(t) in ids]
    module._ddp_params_and_buffers_to_ignore = list(dict.fromkeys(
        [*getattr(module, "_ddp_params_and_buffers_to_ignore", []), *names]))


def run_prompts(data: Any, callbacks: list) -> Optional[list[str]]:
    """The distinct prompts a run conditions on, the empty prompt first; None where the data does not list them."""
    found: Optional[list[str]] = None
    if hasattr(data, "prompt_list"):
        found = list(data.prompt_list())
    elif getattr(data, "train_items", None) is not None:
        found = [caption for _, caption in data.train_items + data.val_items]
    if found is None:
        return None
    for callback in callbacks:
        given = getattr(callback, "prompts", None)
        if isinstance(given, list) and all(isinstance(p, str) for p in given):
            found += given
    return list(dict.fromkeys(["", *found]))
