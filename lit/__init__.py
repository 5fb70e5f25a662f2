"""The methods: one LightningModule per file, in front, on their shared base (``base.py``); behind them
``engine/`` (the sharding strategy, checkpoint I/O, exact resume, log cadence, start-up checks) and ``tools/``
(the ``posttrain`` commands). ``strategy.py`` and ``tracking.py`` here keep the older config paths working.

This package imports every module in its folder and exports every method they define (each subclass of
``ExpertModule``), so that YAML can name a method by its class (``model: {class_path: Finetune}``) and a new method
is one new file here and no edit elsewhere.
"""
import importlib
import pkgutil

from posttrain.lit.base import ExpertModule, RunArgs

__all__ = ["ExpertModule", "RunArgs"]


def _methods() -> dict[str, type]:
    """The ``ExpertModule`` subclasses every module of this folder defines (not ``engine/``, ``tools/``), by name."""
    found: dict[str, type] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.ispkg:
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, type) and issubclass(value, ExpertModule) and value is not ExpertModule \
                    and value.__module__ == module.__name__ and not name.startswith("_"):
                if name in found:
                    raise ValueError(f"method {name!r} is defined twice in lit/ (again in {info.name}.py)")
                found[name] = value
    return found


METHODS: dict[str, type] = _methods()  # every method, by class name
globals().update(METHODS)
__all__ += sorted(METHODS)
