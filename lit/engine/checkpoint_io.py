"""Lightning's checkpoint I/O over the package's on-disk protocol (``posttrain.modules.io.checkpoints``).

Plain (non-sharded) strategies write checkpoint folders atomically with a manifest and read them verified,
weights only; ``ShardedExpertsStrategy`` writes its folders through the same ``write_checkpoint``, with its shards.
It is installed in one place, the method's ``setup`` (``lit/engine/resume.py``), which runs before any checkpoint is
restored or saved.
"""
from __future__ import annotations

from typing import Any, Optional

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from posttrain.modules.io import checkpoints as ckpt


class VerifiedCheckpointIO(CheckpointIO):
    """Checkpoint folders written atomically with a manifest (``ckpt.write_checkpoint``), read by the one verified
    loader (``ckpt.load``: a ZeRO checkpoint's shards gathered for validate / predict)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Optional[Any] = None) -> None:
        ckpt.write_checkpoint(checkpoint, str(path), meta=storage_meta(storage_options),
                              extra=storage_extra(storage_options))

    def load_checkpoint(self, path, map_location: Optional[Any] = None, weights_only: Optional[bool] = None):
        return ckpt.load(str(path))

    def remove_checkpoint(self, path) -> None:
        ckpt.remove_entry(str(path))


def storage_meta(storage_options: Optional[Any]) -> Optional[dict]:
    """The extra manifest fields the checkpoint callback passes in ``storage_options``."""
    return storage_options.get(ckpt.META_OPTION) if isinstance(storage_options, dict) else None


def storage_extra(storage_options: Optional[Any]):
    """The writer of further checkpoint files (a LoRA run's ``adapter/``) the checkpoint callback passes."""
    return storage_options.get(ckpt.EXTRA_OPTION) if isinstance(storage_options, dict) else None


def install_checkpoint_io(strategy) -> None:
    """Make ``strategy`` write and read verified checkpoint folders (idempotent)."""
    if not isinstance(strategy.checkpoint_io, VerifiedCheckpointIO):
        strategy.checkpoint_io = VerifiedCheckpointIO()
