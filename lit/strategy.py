"""Alias kept for configs that name ``posttrain.lit.strategy.ShardedExpertsStrategy``: the strategy lives in
``posttrain.lit.engine.strategy``."""
from posttrain.lit.engine.strategy import ShardedExpertsStrategy  # noqa: F401
