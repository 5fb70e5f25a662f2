"""Alias kept for configs that name ``posttrain.lit.tracking.WandbLogger``: the logger lives in
``posttrain.lit.tools.tracking``."""
from posttrain.lit.tools.tracking import WandbLogger  # noqa: F401
