"""Frozen ``nn.Linear`` weights stored in float8 (e4m3, one scale per output channel) through optimum-quanto, and
models built block by block (``materialize``; a streamed load: ``presets.build_model``) so that a full-precision
copy is never held.

What is quantized (``targets``): the Linear layers inside the model's repeated blocks (Wan's ``blocks``, FLUX's
``transformer_blocks`` and ``single_transformer_blocks``, T5's ``encoder.block``, CLIP's ``encoder.layers``...), which
hold nearly all of its weights. The embeddings, the norms and their modulation Linears (a name with ``norm``) and
everything outside the blocks stay in the expert's ``dtype`` (float32 where the class keeps a module in float32).
That is musubi-tuner's ``fp8_base`` selection (its ``FP8_OPTIMIZATION_TARGET_KEYS`` / ``EXCLUDE_KEYS`` per family),
found from the module tree instead of listed per family.

A quantized layer is quanto's ``QLinear`` (an ``nn.Linear``) whose ``weight`` is a ``WeightQBytesTensor``: its state
dict holds plain tensors, ``weight._data`` (float8_e4m3fn) and ``weight._scale`` (one per output channel, in the
layer's dtype), plus two scalar activation scales; the forward dequantizes and computes in that dtype. peft's LoRA
wraps a ``QLinear`` like any Linear, so a LoRA expert's adapter stays in its dtype and trains.
"""
from __future__ import annotations

import functools
import sys
from typing import Callable, Union

import torch
from torch import nn

QTYPE = "qfloat8_e4m3fn"  # optimum.quanto's name of float8 e4m3 weights; quanto is imported where used, so a run
# without fp8 never loads it


def blocks(model: nn.Module) -> list[str]:
    """The paths of ``model``'s repeated blocks: the children of every outermost ``nn.ModuleList`` whose children
    are all of one class that has submodules of its own (a transformer's layers; not ``to_out = [Linear,
    Dropout]``)."""
    found: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if any(name == path or name.startswith(f"{path}.") for path in found):
            continue  # inside a block already found
        kinds = {type(child) for child in module}
        if len(kinds) == 1 and any(True for _ in module[0].children()):
            found += [f"{name}.{index}" if name else str(index) for index in range(len(module))]
    return found


def targets(model: nn.Module) -> list[str]:
    """The paths of the Linear layers ``quantize`` stores in float8: inside a block (``blocks``), not a norm's (an
    adaptive norm's modulation), not a LoRA adapter's, not quantized yet. One the class keeps in float32 (T5's
    ``wo``) is stored in float8 with float32 scales and still computes in float32."""
    return [f"{path}.{name}" for path in blocks(model) for name in _targets_in(model.get_submodule(path))]


def _targets_in(block: nn.Module) -> list[str]:
    """``targets`` of one block, by their paths inside it."""
    return [name for name, module in block.named_modules() if type(module) is nn.Linear
            and not any("norm" in part or part.startswith("lora_") for part in name.split("."))]


def is_quantized(model: nn.Module) -> bool:
    """Whether ``model`` holds float8 weights (a quanto ``QLinear``)."""
    from optimum.quanto import QLinear

    return any(isinstance(module, QLinear) for module in model.modules())


@torch.no_grad()
def quantize(model: nn.Module, only: Union[str, None] = None) -> nn.Module:
    """Store ``model``'s ``targets`` in float8 in place (quanto's ``quantize`` then ``freeze``), one block at a time,
    so the float copy of one block at most is alive beside the float8 one; ``only``: just the block at that path (a
    loader quantizing each block as its tensors arrive). Layers already quantized are left as they are."""
    from optimum.quanto import freeze, quantize as quanto_quantize

    for path in [only] if only is not None else blocks(model):
        block = model.get_submodule(path)
        names = _targets_in(block)
        if names:
            quanto_quantize(block, weights=QTYPE, include=names)
            freeze(block)
            if "_fp8_hooks" not in block.__dict__:  # once per block
                block.__dict__["_fp8_hooks"] = (block.register_load_state_dict_pre_hook(_hold_weights),
                                                block.register_load_state_dict_post_hook(_keep_weights))
    return model


# quanto's QLinear loads a state dict by replacing its weight with a new Parameter (requires_grad=True): a frozen
# base would turn trainable after a resume, and a role's copy would stop sharing it. The block's hooks (a block
# loads before its layers) write the loaded float8 values into the Parameters its layers had instead.
def _hold_weights(block: nn.Module, *args) -> None:
    from optimum.quanto import QLinear

    # in __dict__: not registered as parameters
    block.__dict__["_fp8_held"] = {id(m): m.weight for m in block.modules() if isinstance(m, QLinear)}


@torch.no_grad()
def _keep_weights(block: nn.Module, incompatible_keys) -> None:
    from optimum.quanto import QLinear

    held_by = block.__dict__.pop("_fp8_held", {})
    for layer in block.modules():
        held, loaded = held_by.get(id(layer)), getattr(layer, "weight", None)
        if not isinstance(layer, QLinear) or held is None or held is loaded:
            continue
        if type(held) is type(loaded) and held._data.shape == loaded._data.shape:
            held._data.copy_(loaded._data)
            held._scale.copy_(loaded._scale)
            layer.weight = held
        else:  # another float8 layout (quanto's CUDA kernels pack theirs): the loaded one, frozen as the held one
            loaded.requires_grad_(held.requires_grad)


def shared(model: nn.Module) -> dict[int, nn.Parameter]:
    """A ``copy.deepcopy`` memo that keeps ``model``'s float8 weights shared with the copy (a role's copy of a frozen
    or LoRA expert): they never train, so one copy serves both, and quanto's tensors cannot be deep-copied."""
    quanto = sys.modules.get("optimum.quanto")
    if quanto is None:  # never imported: nothing was quantized
        return {}
    return {id(p): p for p in model.parameters() if isinstance(p, quanto.QTensor)}


def bytes_per_parameter(in_features: int, dtype: torch.dtype) -> float:
    """Bytes a quantized Linear holds per weight: 1 (float8) plus its output channel's scale (in ``dtype``) shared
    by the ``in_features`` weights of the channel."""
    return 1 + torch.finfo(dtype).bits / 8 / in_features


# ---------------------------------------------------------------------- block by block (built here, loaded by presets)
def units(model: nn.Module) -> list[str]:
    """The blocks, then ``""`` for everything else: the order a block-wise build fills the model in."""
    return [*blocks(model), ""]


def unit_of(name: str, units: list[str]) -> str:
    """The unit of ``units`` (``units(model)``) the parameter or module ``name`` lies in (``""``: outside the
    blocks)."""
    return next((u for u in units if u and (name == u or name.startswith(f"{u}."))), "")


def _named_view(path: str, module: nn.Module) -> nn.Module:
    """A module whose ``named_modules`` names ``module``'s submodules by their path ``path.…`` in the whole model (so
    a per-module seed drawn from the name is the one the whole model's fill draws)."""
    view = module
    for part in reversed(path.split(".")):
        parent = nn.Module()
        parent.add_module(part, view)
        view = parent
    return view


def tie(model: nn.Module) -> None:
    """A transformers model's tied parameters made one again (accelerate's ``init_empty_weights`` gives each name its
    own meta parameter; ``from_pretrained`` ties them after loading, as this does before)."""
    if callable(getattr(model, "tie_weights", None)):
        model.tie_weights()


def give_back_freed_memory() -> None:
    """Return the heap memory freed by a block's float copy to the system (glibc's ``malloc_trim``; nothing elsewhere).

    glibc serves allocations under its mmap threshold — which it raises itself, up to 32 MiB, after freeing a large
    one — from the heap, and keeps what is freed there: a block's bf16 tensors freed after quantization (FLUX's
    3072×3072 weights are 18 MiB) stay resident, and building FLUX.1-dev in float8 peaked above 20 GiB instead of
    its 14 GiB model (``python -m bench.real_size --cases flux_lora_fp8``). Trimming after each block keeps the
    peak at the model plus one block."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


@functools.lru_cache(maxsize=None)
def _libc():
    """The C library, looked up once (``find_library`` runs ``ldconfig`` in a subprocess); None where there is none."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


@torch.no_grad()
def materialize(model: nn.Module, fill: Callable[[nn.Module], object]) -> nn.Module:
    """Fill ``model``, built on the meta device with its buffers real (accelerate's ``init_empty_weights``), block
    by block, each block quantized before the next is allocated: building Wan2.1-14B in bf16 so holds its
    float8 weights and one bf16 block (0.7 GB), never the 28.6 GB bf16 copy.

    ``fill(view)`` gives every meta parameter under ``view`` storage and values (``published.materialize`` with the
    model's seed); ``view`` names its modules by their paths in the whole model, so a fill that seeds each module by
    its name gives the values it gives the whole model at once: the result equals ``fill(model)`` followed by
    ``quantize``, bitwise. What lies outside the blocks is filled last."""
    tie(model)
    for path in blocks(model):
        fill(_named_view(path, model.get_submodule(path)))
        quantize(model, only=path)
        give_back_freed_memory()
    fill(model)
    return model
