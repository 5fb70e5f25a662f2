"""Start-up checks of the trainer a card runs under: what cannot work stops before anything is built, and before
anything is written (the CLI holds the W&B run and ``config.yaml`` until the run starts: ``lit/tools/config.py``).

Experts are stepped by hand, each with its own optimizer and backward: float16 AMP would need a gradient scaler
per expert, sharded experts need ``ShardedExpertsStrategy``, and several plain experts under DDP need
``find_unused_parameters`` (each backward leaves the other experts' parameters without gradient).
"""
from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy

from posttrain.modules.models.cards import ModelCard

SHARDING = "{class_path: posttrain.lit.engine.strategy.ShardedExpertsStrategy}"


def check_trainer(trainer, card: ModelCard) -> None:
    """Refuse a precision, strategy or DDP setting the card's experts cannot train under, naming the fix."""
    if getattr(trainer.precision_plugin, "scaler", None) is not None:  # float16 AMP (GPU)
        raise ValueError(
            f"trainer.precision={trainer.precision}: float16 mixed precision needs a gradient scaler per expert, and "
            f"experts are stepped by hand here without one; use `precision: bf16-mixed` (no scaler needed) or "
            f"`dtype: bfloat16` on the experts")
    strategy = trainer.strategy
    sharded = [name for name, spec in card.specs.items() if spec.sharded]
    if sharded and not hasattr(strategy, "expert_backward"):
        raise ValueError(
            f"experts {sharded} have `sharded: true`, but trainer.strategy is {type(strategy).__name__}, which does "
            f"not shard: set `trainer.strategy: {SHARDING}`, or `sharded: false` on those experts")
    # each expert's backward leaves the other experts' parameters without gradient: DDP must expect that
    plain = [name for name in card.trainable if not card.specs[name].sharded]
    if isinstance(strategy, DDPStrategy) and strategy.world_size > 1 and len(plain) > 1 \
            and not strategy._ddp_kwargs.get("find_unused_parameters", False):
        raise ValueError(
            f"experts {plain} train under DDP with separate backward passes, which needs find_unused_parameters: "
            f"set `trainer.strategy: ddp_find_unused_parameters_true`, or `{SHARDING}` (it sets it)")
