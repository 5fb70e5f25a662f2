"""Exact resume: what a checkpoint holds beyond Lightning's own state, and the RNG discipline that makes a
resumed run continue bitwise where the uninterrupted one goes.

``ExactResume`` is a mixin of ``ExpertModule``:

- ``setup``: the method's noise generators (``generator``, one stream per process; ``shared_generator``, the
  same stream on every process) are seeded, and the strategy writes and reads verified checkpoint folders
  (``lit/engine/checkpoint_io.py``);
- ``on_save_checkpoint`` adds a ``posttrain`` entry: the card's signature, each expert's config, arch and source,
  the serving settings (``posttrain export`` reads them), the noise generators of every process, the global
  RNGs (torch, numpy, python, CUDA), the accumulation and non-finite counters; what a source rebuilds exactly is
  left out of ``state_dict`` (a SHA-256 of it is kept instead): frozen experts whose weights a file holds, and
  the base of a LoRA expert (``ModelCard.reloadable``), so a LoRA checkpoint holds the adapter; a text encoder
  not loaded (``Expert.precomputed``, on the meta device) is left out too, so a run resumes with or without it;
- ``on_load_checkpoint`` refuses a checkpoint of another card before anything loads, puts back what was left out
  from the freshly built card's sources (refusing a source that changed), and every state above — for ``validate`` and
  ``predict`` too, which is why these are the module's hooks and not a callback's (a callback's
  ``on_load_checkpoint`` runs only when fitting, after the weights are loaded);
- only training draws from the global RNGs (below).

Lightning's own ``_collect_rng_states`` / ``_set_rng_states`` take and restore the global RNGs.
"""
from __future__ import annotations

import random
from dataclasses import replace
from typing import Any, Mapping

import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn

from posttrain.callbacks.checkpoints import wandb_run_id_of
from posttrain.lit.engine.checkpoint_io import install_checkpoint_io


class ExactResume(LightningModule):
    """Needs ``self.card``, ``self.run.seed``, ``self.generator``, ``self.shared_generator``, ``self._micro``,
    ``self._nan_streak`` and ``self.serving_settings()`` (all ``ExpertModule``'s)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._frozen_digests: dict[str, str] = {}  # expert -> SHA-256 of what its source rebuilds (computed once)
        self._rng_between_batches = None

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self._seed_generators()
        install_checkpoint_io(self.trainer.strategy)  # verified checkpoint folders, weights only

    def _seed_generators(self) -> None:
        """The method's streams from ``run.seed``: one per data-parallel rank (the processes of a sequence group
        share a sample, and its noise), and the shared one."""
        data_rank = (getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}).get(
            "rank", self.global_rank)
        self.generator = torch.Generator().manual_seed(self.run.seed + data_rank)
        self.shared_generator = torch.Generator().manual_seed(self.run.seed)

    # ------------------------------------------------------------------ only training draws from the global RNGs
    # Between two training batches Lightning may run a validation, or, in a resumed run, fast-forward over the one
    # the checkpoint was taken before (building the validation loader's iterator draws a seed from the global
    # torch RNG). Those draws would make a resumed run differ from an uninterrupted one, so the global RNG states
    # are taken when training starts and after every training batch, and put back before the next one (and at the
    # end of a validation epoch, before a checkpoint callback could save in ``on_validation_end``).
    def on_train_start(self) -> None:
        super().on_train_start()
        self._rng_between_batches = _collect_rng_states(include_cuda=torch.cuda.is_available())

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        self._rng_between_batches = _collect_rng_states(include_cuda=torch.cuda.is_available())

    def on_train_batch_start(self, batch, batch_idx) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._rng_between_batches is not None:
            _set_rng_states(self._rng_between_batches)

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        trainer = self.trainer
        if self._rng_between_batches is not None and trainer.state.fn == "fit" and not trainer.sanity_checking:
            _set_rng_states(self._rng_between_batches)

    # ------------------------------------------------------------------ the checkpoint's `posttrain` entry
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        frozen = self._leave_out_frozen(checkpoint.get("state_dict", {}))
        generators = [self.generator.get_state()]
        if dist.is_available() and dist.is_initialized():
            generators = [None] * dist.get_world_size()
            dist.all_gather_object(generators, self.generator.get_state())
        run_id = wandb_run_id_of(self.trainer)
        checkpoint["posttrain"] = {
            "signature": self.card.signature(),
            "configs": {name: model_config(model) for name, model in self.card.models.items()},
            "arch": {name: spec.arch for name, spec in self.card.specs.items()},
            "sources": self.card.sources(),
            "serving": self.serving_settings(),
            "run": {"wandb_id": None if run_id is None else str(run_id), "seed": self.run.seed},
            "frozen": frozen,
            "generators": generators,
            "shared_generator": self.shared_generator.get_state(),
            "micro": dict(self._micro),
            "nan_streak": dict(self._nan_streak),
            "rng": {"torch": torch.get_rng_state(), "numpy": _numpy_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("posttrain")
        if state is None:
            raise ValueError("this checkpoint was not written by posttrain (no 'posttrain' entry); "
                             "load plain weights with `pretrained:` on the expert instead")
        check_signature(state["signature"], self.card.signature())
        self._restore_frozen(checkpoint, state.get("frozen") or {})
        check_state_fits(checkpoint["state_dict"], self.state_dict(keep_vars=True))
        seed = (state.get("run") or {}).get("seed")
        if seed is not None and seed != self.run.seed:  # e.g. `seed_everything: true` draws a new seed each launch
            rank_zero_warn(f"resuming a run seeded {seed} (run.seed) from a launch seeded {self.run.seed}: the run "
                           f"keeps its own seed, so it continues exactly (what it draws from the seed, such as DMD2's "
                           f"teacher pairs, is what it drew before)")
            self.run = replace(self.run, seed=seed)
            self._seed_generators()  # a process the checkpoint has no stream for starts from the run's seed too
        generators = state["generators"]  # one per process that wrote the checkpoint
        if self.global_rank < len(generators):  # a process beyond them keeps its own fresh stream (seed + rank)
            self.generator.set_state(generators[self.global_rank])
        if "shared_generator" in state:
            self.shared_generator.set_state(state["shared_generator"])
        self._micro = dict(state["micro"])
        self._nan_streak = dict(state["nan_streak"])
        torch.set_rng_state(state["rng"]["torch"])
        _set_numpy_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        if state["rng"].get("cuda") and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])

    def _leave_out_frozen(self, state_dict: dict) -> dict:
        """Remove from ``state_dict`` the weights a resume rebuilds from their source (``card.reloadable``): frozen
        experts read from a file (the UMT5 of Wan 1.3B alone is ~23 GB in fp32) and the base of a LoRA expert (~2.8
        GB of Wan 1.3B in bf16 in every save; the adapter stays). Returns the checkpoint's ``frozen`` entry: per
        expert the SHA-256 of what was left out (computed once: it never changes) and its source; per LoRA role (an
        EMA or ``old`` copy) ``base_of`` that expert: a role is a copy of its expert, and its sync plan blends only
        what trains (``SyncPlan.pairs``), so its base is the expert's."""
        frozen = {}
        sources = self.card.sources()
        rows = self._rows_digests()
        for name in self.card.unloaded:  # on the meta device: no weights to keep; the digest of those of the rows
            self._drop(state_dict, name, self.card.models[name].state_dict())
            frozen[name] = {"sha256": rows.get(name), "source": sources[name], "precomputed": True}
        for name in self.card.reloadable():
            spec = self.card.specs[name]
            # a sharded LoRA expert is not in `state_dict`: its engine saves it without the base
            dropped = self._drop(state_dict, name, self.card.frozen_state(name))
            if dropped or (spec.sharded and spec.lora is not None):
                frozen[name] = {"sha256": self._digest(name), "source": sources[name]}
        for name, (of, _) in self.card.roles.items():
            if of in frozen and self.card.specs[of].lora is not None and name in self.card.models \
                    and self._drop(state_dict, name, self.card.frozen_state(name)):
                frozen[name] = {"base_of": of}
        return frozen

    def _rows_digests(self) -> dict[str, str]:
        """The weights SHA-256 of each expert that made the run's precomputed rows (``PrecomputedVideos``' manifest:
        ``weights_digest``, what ``_digest`` gives for a loaded frozen expert), {} without such data."""
        manifest = getattr(getattr(self._trainer, "datamodule", None), "manifest", None) or {}
        return dict(manifest.get("sources") or {})

    def _digest(self, name: str) -> str:
        """SHA-256 of what expert ``name``'s source rebuilds (``weights_digest``), computed once: it never changes."""
        if name not in self._frozen_digests:
            self._frozen_digests[name] = self.card.weights_digest(name, frozen_only=True)
        return self._frozen_digests[name]

    @staticmethod
    def _drop(state_dict: dict, name: str, keys) -> bool:
        """Delete component ``name``'s ``keys`` from ``state_dict``; whether it held them (a sharded expert's engine
        saves its own weights, so they are not there)."""
        prefix = f"card.models.{name}."
        held = [prefix + key for key in keys if prefix + key in state_dict]
        for key in held:
            del state_dict[key]
        return bool(held)

    def _restore_frozen(self, checkpoint: dict, frozen: dict) -> None:
        """Put back the weights the checkpoint left out (frozen experts, LoRA bases), from their sources in the
        freshly built card, after checking that each source still holds the weights the checkpoint was trained
        with. A checkpoint written before LoRA bases were left out holds them: they simply load."""
        state_dict = checkpoint["state_dict"]
        for name in self.card.unloaded:  # whatever the checkpoint holds of it, the run keeps its meta tensors
            prefix = f"card.models.{name}."
            for key in [k for k in state_dict if k.startswith(prefix)]:
                del state_dict[key]
            state_dict.update({prefix + key: value for key, value in self.card.models[name].state_dict().items()})
        rows = self._rows_digests()
        for name, saved in frozen.items():
            if "base_of" in saved:  # a LoRA role: its base is its expert's, whose own entry checks the source
                continue
            if name in self.card.unloaded:  # its weights now are those that made the rows (callbacks.precomputed)
                if saved.get("sha256") and rows.get(name) and rows[name] != saved["sha256"]:
                    raise ValueError(f"text encoder {name!r} (not loaded: precomputed) made the rows with other "
                                     f"weights than this checkpoint was trained with (SHA-256 {rows[name][:12]}… vs "
                                     f"{saved['sha256'][:12]}…): resume on rows of the checkpoint's encoder "
                                     f"(`posttrain preprocess` with its source), or start a new run")
                continue
            if saved.get("sha256") is None:  # written without it loaded, and without rows that name its weights
                continue
            digest = self._digest(name)
            if digest != saved["sha256"]:
                source = saved.get("source") or {}
                where = source.get("pretrained") or (f"published {source['published']!r}, its seeded weights"
                                                     if source.get("published") else
                                                     f"the shipped {source.get('arch')!r} weights")
                lora = source.get("lora") is not None
                subject, weights, trained, closing = (
                    (f"the base of LoRA expert {name!r}", "base weights", "this checkpoint's adapter was trained on",
                     ", and the checkpoint holds the adapter alone. Restore that source to resume, or start a new run "
                     "on the new base") if lora else
                    (f"frozen expert {name!r}", "weights", "this checkpoint was trained with",
                     ". Restore that source, or start a new run from the checkpoint's trained experts"))
                raise ValueError(f"{subject} is not the one {trained}: its source ({where}) changed since ({weights} "
                                 f"SHA-256 {digest[:12]}… vs {saved['sha256'][:12]}…){closing}")
        for name, saved in frozen.items():
            if name in self.card.unloaded:
                continue
            prefix = f"card.models.{name}."
            lora = "base_of" in saved or (saved.get("source") or {}).get("lora") is not None
            if lora and not any(key.startswith(prefix) for key in state_dict):
                continue  # a sharded LoRA expert's engine loads its adapter; its module kept the source's base
            for key, value in self.card.frozen_state(name).items():
                state_dict[prefix + key] = value


def check_signature(saved: dict, current: dict, shown: int = 3) -> None:
    """Refuse a checkpoint whose experts differ from the card's: how many differ, the first ``shown`` of them,
    the names of the rest, and the fix."""
    problems, names = [], []
    for name in sorted(set(saved) | set(current)):
        if name not in current:
            problems.append(f"checkpoint has expert {name!r} ({saved[name]}), the card does not")
        elif name not in saved:
            problems.append(f"the card has expert {name!r} ({current[name]}), the checkpoint does not")
        elif saved[name] != current[name]:
            problems.append(f"expert {name!r} differs: checkpoint {saved[name]} vs card {current[name]}")
        else:
            continue
        names.append(name)
    if problems:
        rest = f"\n  - and {len(names) - shown} more: {', '.join(map(repr, names[shown:]))}" \
            if len(names) > shown else ""
        raise ValueError(f"checkpoint does not match this model card ({len(names)} expert(s) differ); nothing was "
                         f"loaded:\n  - " + "\n  - ".join(problems[:shown]) + rest
                         + "\nResume with the config the checkpoint was trained with, or start a new run.")


def check_state_fits(saved: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor], shown: int = 3) -> None:
    """Refuse a checkpoint whose weights do not fit the module though its experts match (``check_signature``):
    modules a method adds to an expert from its settings (DMD2's GAN head on the critic: ``gan.critic_weight``,
    ``gan.blocks``, ``gan.space``) differ from the run that wrote it. Compared: the keys the checkpoint holds (a
    sharded expert's engine saves its own, so its keys are in neither list here) and, for each expert the checkpoint
    holds keys of, the keys it lacks."""
    def expert(key: str) -> str:
        return ".".join(key.split(".")[:3])  # card.models.<name>

    held = {expert(k) for k in saved}
    problems = [f"{k}: checkpoint {tuple(v.shape)} vs run {tuple(current[k].shape)}" for k, v in saved.items()
                if k in current and tuple(v.shape) != tuple(current[k].shape)]
    problems += [f"{k}: in the checkpoint, not in the run" for k in saved if k not in current]
    problems += [f"{k}: in the run, not in the checkpoint" for k in current if k not in saved and expert(k) in held]
    if problems:
        rest = f"\n  - and {len(problems) - shown} more" if len(problems) > shown else ""
        raise ValueError(f"checkpoint weights do not fit this run's modules ({len(problems)} differ); nothing was "
                         f"loaded:\n  - " + "\n  - ".join(problems[:shown]) + rest
                         + "\nA setting that adds or reshapes a module (DMD2's GAN head: gan.critic_weight, "
                           "gan.blocks, gan.space) differs from the run that wrote it: resume with its config "
                           "(config.yaml beside the run), or start a new run.")


def model_config(model: torch.nn.Module) -> dict:
    """The constructor config of a diffusers or transformers model, as a plain dict."""
    config = getattr(model, "config", None)
    if config is None:
        return {}
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    if "_use_default_values" in config:  # diffusers lists a set here: its order changes with the process
        config["_use_default_values"] = sorted(config["_use_default_values"])
    return config


def _numpy_state() -> dict:
    """numpy's RNG state in types that ``torch.load(weights_only=True)`` accepts."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
            "gauss": float(gauss)}


def _set_numpy_state(state: dict) -> None:
    np.random.set_state(("MT19937", state["keys"].numpy().astype(np.uint32), state["pos"], state["has_gauss"],
                         state["gauss"]))
