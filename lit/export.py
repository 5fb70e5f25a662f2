"""``posttrain export``: a trained expert as a standalone ``from_pretrained`` folder.

Reads a checkpoint written by ``posttrain fit`` (a ``.ckpt`` file, or the folder the sharded strategy
writes) and saves one expert with the model class's own ``save_pretrained``: the folder loads with
``WanTransformer3DModel.from_pretrained(out)`` (or ``Qwen2ForCausalLM``…) without this package.

    posttrain export --ckpt runs/finetune/checkpoints/last.ckpt --out exported/transformer
"""
from __future__ import annotations

import os
from typing import Literal

import torch

from posttrain.modules import presets


def load_checkpoint(ckpt: str) -> dict:
    """The Lightning checkpoint dict of a checkpoint folder (verified against its manifest; ZeRO shards
    gathered into full weights) or of a single ``.ckpt`` file; never unpickles anything but weights."""
    from posttrain.lit import checkpoints

    if os.path.isdir(ckpt):
        from posttrain.lit.strategy import gather_sharded

        return gather_sharded(ckpt, checkpoints.load(ckpt))
    return checkpoints.load(ckpt)


def export(ckpt: str, out: str, expert: str = "transformer",
           dtype: Literal["float32", "bfloat16"] = "float32", overwrite: bool = False) -> str:
    """Write ``expert`` of checkpoint ``ckpt`` to folder ``out`` in the diffusers/transformers layout.

    Args:
        ckpt: a ``.ckpt`` file or a sharded checkpoint folder.
        out: the folder to write.
        expert: the component to export (``transformer``, ``transformer_ema``, ``refiner_0``…).
        dtype: the dtype of the written weights.
        overwrite: write into ``out`` even if it is a folder that is not empty.
    """
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise FileExistsError(f"--out {out!r} is a folder that is not empty; choose a new folder, or pass "
                              f"--overwrite to write into it")
    if os.path.exists(out) and not os.path.isdir(out):
        raise FileExistsError(f"--out {out!r} is a file; give a folder path")
    checkpoint = load_checkpoint(ckpt)
    meta = checkpoint.get("posttrain")
    if meta is None:
        raise ValueError(f"{ckpt!r} was not written by posttrain fit (no 'posttrain' entry)")
    configs, archs = meta["configs"], dict(meta["arch"])
    for name, sig in meta["signature"].items():  # roles (transformer_ema…) share their source's arch
        if "role_of" in sig:
            archs[name] = archs[sig["role_of"]]
    if expert not in configs:
        raise ValueError(f"checkpoint has no component {expert!r}; components: {sorted(configs)}")
    prefix = f"card.models.{expert}."
    state = {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    cls = presets.model_class(archs[expert])
    config = {k: v for k, v in configs[expert].items() if not k.startswith("_")}
    if hasattr(cls, "from_config"):
        model = cls.from_config(config)
    else:
        model = cls(cls.config_class.from_dict(configs[expert]))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{expert!r} weights do not fit its class {cls.__name__}: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]} (a LoRA expert: merge the adapter before export)")
    model.to({"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
    model.save_pretrained(out, safe_serialization=True)
    return out
