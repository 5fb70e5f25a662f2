"""Weight versions through a run: after each iteration the versions of the experts that stepped are bumped and
their sync plans run (``posttrain.modules.models.versions``); versions are logged as ``train/version/<component>`` and
travel in checkpoints.
"""
from __future__ import annotations

from lightning.pytorch import Callback

from posttrain.modules.models.versions import bump


class WeightVersions(Callback):
    """Bumps versions, runs sync plans, invalidates caches, logs and checkpoints the versions."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        card = pl_module.card
        bump(card, pl_module.stepped, pl_module.sync_plans)
        pl_module.stepped.clear()
        for name, version in card.versions.items():
            pl_module.log(f"train/version/{name}", float(version), on_step=True,
                          prog_bar=name in card.trainable)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        checkpoint["posttrain_versions"] = dict(pl_module.card.versions)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        saved = checkpoint.get("posttrain_versions", {})
        unknown = set(saved) - set(pl_module.card.versions)
        if unknown:
            raise ValueError(f"checkpoint has versions of components {sorted(unknown)} that the card lacks")
        pl_module.card.versions.update(saved)
