"""What the console shows during ``fit``: one progress bar in iterations, one summary row per expert.

Lightning's defaults count batches per epoch (``Epoch 2/-2`` when ``max_steps`` bounds the run) and
summarise the LightningModule as one ``card`` row. Users think in iterations and experts.
"""
from __future__ import annotations

import logging

from lightning.pytorch.callbacks import ModelSummary, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import _update_n, convert_inf

log = logging.getLogger("lightning.pytorch.utilities.rank_zero")


class IterationProgressBar(TQDMProgressBar):
    """One bar for the whole run: iteration / ``max_steps`` (resumed runs start where they stopped), with
    each expert's loss (``train/loss/<expert>``), the reward and each trainable expert's learning rate."""

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self.on_train_epoch_start(trainer)  # a run resumed inside an epoch starts no epoch before its first batch

    def on_train_epoch_start(self, trainer, *_) -> None:
        total = trainer.max_steps if trainer.max_steps > 0 else convert_inf(
            trainer.num_training_batches * max(trainer.max_epochs or 1, 1))
        bar = self.train_progress_bar
        if bar.total != total:
            bar.reset(total)
        bar.initial = 0
        bar.n = trainer.global_step
        bar.set_description("iteration")

    # ``global_step`` counts an iteration when ``IterationCounter`` (a model callback, run after this one) ends
    # its batch: the bar shows the iterations completed when the next one starts, and at the end of training
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        n = trainer.global_step
        if n > 0 and self._should_update(n, self.train_progress_bar.total):
            _update_n(self.train_progress_bar, n)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)

    def on_train_end(self, trainer, pl_module) -> None:
        _update_n(self.train_progress_bar, trainer.global_step)
        super().on_train_end(trainer, pl_module)

    def get_metrics(self, trainer, pl_module) -> dict:
        shown = {}
        for key, value in trainer.callback_metrics.items():
            name = key.removeprefix("train/")
            if key in ("train/reward", "val/loss", "val/reward") or key.startswith(("train/loss/", "val/geneval")):
                shown[name] = f"{float(value):.4g}"
            elif key.startswith("train/lr/"):
                shown[name] = f"{float(value):.2e}"
        return shown


class ExpertSummary(ModelSummary):
    """Replaces Lightning's one-row summary: each component of the card with its class, trainable and
    frozen parameters, and how it trains (optimizer, sharding, role)."""

    def on_fit_start(self, trainer, pl_module) -> None:
        card = getattr(pl_module, "card", None)
        if card is None or not trainer.is_global_zero:
            return super().on_fit_start(trainer, pl_module)
        rows = [("component", "class", "trainable", "frozen", "trains as")]
        totals = [0, 0]
        for name, module in card.models.items():
            counts = [0, 0]
            for p in module.parameters():
                counts[0 if p.requires_grad else 1] += getattr(p, "ds_numel", p.numel())
            totals = [totals[0] + counts[0], totals[1] + counts[1]]
            rows.append((name, type(module).__name__, _count(counts[0]), _count(counts[1]), _how(card, name)))
        rows.append(("total", "", _count(totals[0]), _count(totals[1]), ""))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(c.ljust(w) if i < 2 or i == 4 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                 for r in rows]
        log.info("\n".join([lines[0], "-" * len(lines[0]), *lines[1:-1], "-" * len(lines[0]), lines[-1]]))


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def _how(card, name: str) -> str:
    if name in card.roles:
        of, role = card.roles[name]
        return f"{role} of {of}"
    spec = card.specs[name]
    if spec.precomputed:
        return "not loaded (rows)"
    if not spec.trainable:
        return "frozen"
    parts = [_optimizer_name(spec.optimizer)]
    if spec.lora is not None:
        parts.append(f"LoRA r={spec.lora.rank}")
    if spec.sharded:
        parts.append(f"ZeRO-{spec.zero.stage}")
    return ", ".join(parts)


def _optimizer_name(optimizer) -> str:
    """``AdamW(lr=0.001)`` from a YAML optimizer callable (a partial over the class) or a plain callable."""
    import torch

    classes = [a for a in getattr(optimizer, "args", ()) if isinstance(a, type) and issubclass(a, torch.optim.Optimizer)]
    lr = (getattr(optimizer, "keywords", None) or {}).get("lr")
    name = classes[0].__name__ if classes else getattr(optimizer, "__name__", "optimizer")
    return f"{name}(lr={lr:g})" if lr is not None else name
