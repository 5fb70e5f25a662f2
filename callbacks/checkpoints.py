"""``ModelCheckpoint`` with atomic, verified checkpoints and one unambiguous ``last``.

Lightning's ``ModelCheckpoint`` with these changes (same arguments; configs name
``posttrain.callbacks.checkpoints.ModelCheckpoint``):

- every checkpoint is a folder written by ``posttrain.modules.io.checkpoints`` (temporary name, fsync, manifest,
  rename), so a kill never leaves a torn checkpoint where a resume would read it;
- ``last.ckpt`` is a symlink switched atomically to the newest checkpoint (to the top-k checkpoint of that
  iteration, or to a hidden ``.last/`` one when none was written); a rerun never writes ``last-v1.ckpt``;
- ``--ckpt_path last`` resolves to what ``last.ckpt`` points to if it verifies, else to the newest checkpoint
  that does, saying so; a checkpoint of a run that then failed (e.g. the NaN stop) is resumed only with a
  message that names the newest checkpoint of an earlier, healthy run;
- under manual optimization (every posttrain method) the checkpoint is taken after the iteration — all experts
  stepped, versions bumped, the data position advanced — which is the state a resume must continue from.
  Lightning's own manual-optimization path warns and saves the same thing;
- when a validation follows that iteration, the checkpoint is taken at the validation's end, so a resume neither
  skips that validation's metrics nor miscounts Lightning's loops;
- with ``save_last``, a fit that ends off the cadence (``max_steps`` not a multiple of ``every_n_train_steps``)
  checkpoints its final iteration too;
- a run that serves a generator trained through a LoRA adapter writes that adapter alone into every checkpoint, as
  ``adapter/`` (bfloat16, diffusers and original key names: ``modules/io/lora.py``), inside the folder before its
  manifest, so it is verified and committed with the checkpoint.
"""
from __future__ import annotations

import os
import time
from typing import Any, Literal, Optional, Sequence
from weakref import proxy

from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from posttrain.modules.io import checkpoints as ckpt
from posttrain.modules.io import lora


class ModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (same arguments) writing atomic, verified checkpoint folders.

    ``enable_version_counter`` defaults to False here: a name written again (a rerun in the same folder)
    replaces the old checkpoint atomically instead of adding ``-v1``.
    """

    def __init__(self, *args: Any, enable_version_counter: bool = False, keep_last: Optional[int] = None,
                 adapter_formats: Optional[Sequence[Literal["diffusers", "comfyui"]]] = None,
                 **kwargs: Any):
        """``keep_last``: keep only the newest k checkpoints of the folder (and whatever ``last.ckpt`` points to);
        None keeps what ``save_top_k`` keeps (with no ``monitor``, Lightning allows only -1, 0 and 1).
        ``adapter_formats``: the files of a LoRA run's ``adapter/``; None: every format the generator's family has
        (diffusers and comfyui for Wan and FLUX); empty: no ``adapter/``."""
        super().__init__(*args, enable_version_counter=enable_version_counter, **kwargs)
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"ModelCheckpoint: keep_last={keep_last} must be >= 1 (or null: keep all)")
        self.keep_last = keep_last
        self.adapter_formats = None if adapter_formats is None else tuple(adapter_formats)
        self._left_out: set[str] = set()  # formats that failed once (a layer without an original name): not retried
        self._cleaned = False
        self._wrote = False  # whether this fit wrote a checkpoint (only then can `last` be the failed run's)
        self._pending_removals: list[str] = []
        self._save_after_validation = False

    # ------------------------------------------------------------------ resolve `last`
    def _checkpoint_dir(self, trainer) -> str:
        if self.dirpath is not None:
            return str(self.dirpath)
        return str(self._ModelCheckpoint__resolve_ckpt_dir(trainer))  # Lightning's (private) default folder

    def _find_last_checkpoints(self, trainer) -> set[str]:
        """``--ckpt_path last``: one verified checkpoint (Lightning picks the newest file among several)."""
        path = ckpt.resolve_last(self._checkpoint_dir(trainer), say=rank_zero_warn)
        return {path} if path else set()

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._restored, self._not_empty = False, None
        super().setup(trainer, pl_module, stage)
        if not _is_local_file_protocol(str(self.dirpath)):
            raise ValueError(f"ModelCheckpoint dirpath {self.dirpath!r}: atomic checkpoints need a local or shared "
                             f"POSIX folder (rename and fsync); write there and copy to remote storage afterwards")
        # the strategy's checkpoint I/O (verified folders, ``lit/engine/checkpoint_io.py``) is installed by the
        # method's ``setup``, which runs before any checkpoint is restored or saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._restored = True  # this fit resumes from a checkpoint

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        if self._not_empty is not None and not self._restored:
            super()._ModelCheckpoint__warn_if_dir_not_empty(self._not_empty)  # a new run into a used folder
        fit_loop = trainer.fit_loop
        progress = fit_loop.epoch_progress.current
        if fit_loop.restarted_mid_epoch and fit_loop.epoch_loop.restarted_on_train_batch_end \
                and progress.ready == progress.processed:
            # Resumed from a checkpoint taken on an epoch's last batch: Lightning closed that epoch in its reset
            # but would enter the next one as if mid-epoch, skipping its start (counters, on_train_epoch_start
            # hooks); the uninterrupted run starts it normally, so let the loop do that.
            fit_loop.reset_restart_stage()

    def _ModelCheckpoint__warn_if_dir_not_empty(self, dirpath) -> None:
        """Lightning's (private) "Checkpoint directory exists and is not empty" warning, deferred to the start of
        training and given only when this fit did not resume from a checkpoint (where the folder is expected to
        hold checkpoints). The checkpoint is restored after ``setup``, so ``setup`` cannot tell."""
        self._not_empty = dirpath

    # ------------------------------------------------------------------ when to save
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """Save on ``every_n_train_steps`` / ``train_time_interval`` after the whole iteration, under manual and
        automatic optimization alike (``IterationCounter`` has already counted this iteration), and, with
        ``save_last``, on the fit's final iteration."""
        if self._should_skip_saving_checkpoint(trainer):
            return
        skip_batch = self._every_n_train_steps < 1 or trainer.global_step % self._every_n_train_steps != 0
        # the fit's final iteration off the cadence (max_steps not a multiple of it): saved like one on it, mid-loop,
        # so a resume with a larger max_steps continues exactly (Lightning's end-of-fit save would not: its loops have
        # closed the epoch by then)
        final = 0 < trainer.max_steps <= trainer.global_step
        skip_batch = skip_batch and not (final and self.save_last and self._every_n_train_steps >= 1)
        skip_time, now = True, time.monotonic()
        if self._train_time_interval is not None:
            previous = self._last_time_checked
            skip_time = previous is None or now - previous < self._train_time_interval.total_seconds()
            skip_time = trainer.strategy.broadcast(skip_time)  # one decision for all processes
        if skip_batch and skip_time:
            return
        if not skip_time:
            self._last_time_checked = now
        candidates = self._monitor_candidates(trainer)
        if self.monitor is not None and self.monitor not in candidates:
            self._defer_save_until_validation = True  # saved in on_validation_end, once the metric exists
            return
        if validation_follows(trainer):
            # A validation runs right after this batch. Saved now, the checkpoint would precede it, and a resume
            # would skip it (Lightning fast-forwards over it): its metrics would be lost. Saved at its end, the
            # checkpoint holds it; training state is the same (only training draws from the global RNGs).
            self._save_after_validation = True
            return
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._save_after_validation and not trainer.sanity_checking:
            self._save_after_validation = False
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        super().on_validation_end(trainer, pl_module)

    # ------------------------------------------------------------------ how to save
    def _save_checkpoint(self, trainer, filepath: str) -> None:
        if trainer.is_global_zero and not self._cleaned:
            ckpt.clean_stale(self._checkpoint_dir(trainer))  # what killed saves left behind
        self._cleaned = True
        options: dict[str, Any] = {ckpt.META_OPTION: {"wandb_run_id": wandb_run_id_of(trainer)}}
        adapters = self._adapters(trainer)
        if adapters is not None:
            options[ckpt.EXTRA_OPTION] = adapters
        trainer.save_checkpoint(filepath, self.save_weights_only, storage_options=options)
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        self._wrote = True
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))

    def _adapters(self, trainer):
        """The writer of ``adapter/`` into a checkpoint's temporary folder (``ckpt.write_checkpoint``'s ``extra``):
        the LoRA adapter of each generator the run serves (the EMA copy's when it keeps one), computed now, before
        the write; None on other processes and for a run without one. One served adapter fills ``adapter/``, several
        (a workflow) ``adapter/<expert>/``."""
        module = trainer.lightning_module
        if not trainer.is_global_zero or self.adapter_formats == () or not hasattr(module, "card"):
            return None
        prepared = []
        for adapter in lora.card_adapters(module.card, module.serving_settings()):
            formats = [f for f in self.adapter_formats or lora.formats_of(adapter.arch) if f not in self._left_out]
            if not formats:
                continue
            try:
                prepared.append(lora.prepare(adapter, formats))
            except ValueError as err:  # no original name for a layer: warned once, that file left out from now on
                self._left_out.add("comfyui")
                rank_zero_warn(f"checkpoint {lora.FOLDER}/ of {adapter.expert!r}: {err}; its comfyui file is left "
                               f"out of every checkpoint of this run")
                if formats != ["comfyui"]:
                    prepared.append(lora.prepare(adapter, [f for f in formats if f != "comfyui"]))
        if not prepared:
            return None

        def write(temp: str) -> None:
            for files in prepared:
                folder = os.path.join(temp, lora.FOLDER)
                files.write(folder if len(prepared) == 1 else os.path.join(folder, files.adapter.expert))
        return write

    def _save_last_checkpoint(self, trainer, monitor_candidates: dict) -> None:
        """Point ``last.ckpt`` at this iteration's checkpoint, writing a hidden one if top-k wrote none."""
        if not self.save_last:
            return
        dirpath = self._checkpoint_dir(trainer)
        if self._last_checkpoint_saved and self._last_global_step_saved == trainer.global_step:
            target = self._last_checkpoint_saved
        else:
            name = os.path.basename(self.format_checkpoint_name(monitor_candidates))
            target = os.path.join(dirpath, ckpt.HIDDEN, name)
            self._save_checkpoint(trainer, target)
        self.last_model_path = os.path.join(dirpath, ckpt.LAST)
        if trainer.is_global_zero:
            current = ckpt.last_target(dirpath)
            if current is None or os.path.realpath(current) != os.path.realpath(target):
                ckpt.link_last(dirpath, target)
            for path in self._pending_removals:
                ckpt.remove_entry(path)
            ckpt.prune_hidden(dirpath, keep=2)
            self._retain(dirpath)
        self._pending_removals = []
        trainer.strategy.barrier("posttrain_last_checkpoint")

    def _retain(self, dirpath: str) -> None:
        """Remove the folder's checkpoints beyond the newest ``keep_last`` (never the one ``last.ckpt`` names)."""
        if self.keep_last is None:
            return
        named = [path for path in ckpt.entries(dirpath) if os.path.dirname(path) == os.path.abspath(dirpath)]
        last = os.path.realpath(ckpt.last_target(dirpath) or "")
        for path in named[self.keep_last:]:
            if os.path.realpath(path) != last:
                ckpt.remove_entry(path)

    def _remove_checkpoint(self, trainer, filepath: str) -> None:
        """Top-k removals wait while ``last.ckpt`` still points at the checkpoint (until it is switched)."""
        current = ckpt.last_target(self._checkpoint_dir(trainer)) if trainer.is_global_zero else None
        if current is not None and os.path.realpath(current) == os.path.realpath(filepath):
            self._pending_removals.append(filepath)
            return
        super()._remove_checkpoint(trainer, filepath)

    # ------------------------------------------------------------------ failed runs
    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        interrupted = isinstance(exception, (KeyboardInterrupt, SIGTERMException))  # stopped, not failed
        if trainer.state.fn == TrainerFn.FITTING and trainer.is_global_zero and not interrupted and self._wrote:
            try:
                ckpt.note_failure(self._checkpoint_dir(trainer), exception, trainer.global_step)
            except OSError as err:  # a full disk: the run's own error is the one to report
                rank_zero_warn(f"could not record in {self._checkpoint_dir(trainer)!r} that this run failed ({err})")


def validation_follows(trainer) -> bool:
    """Whether the fit loop runs a validation right after the current training batch (Lightning's own test)."""
    loop = trainer.fit_loop.epoch_loop
    try:
        due = loop._should_check_val_fx(trainer.fit_loop._data_fetcher)
    except Exception:  # another Lightning version: save before the validation, as Lightning does
        return False
    batches = trainer.num_val_batches
    return bool(due) and sum(batches if isinstance(batches, list) else [batches]) > 0


def wandb_run_id_of(trainer) -> Any:
    """The W&B run id of the trainer's ``WandbLogger`` (kept in every manifest for resuming the same run)."""
    for logger in trainer.loggers:
        if type(logger).__name__ == "WandbLogger":
            return logger.version
    return None
