"""Frozen modules kept where they are, whatever moves their parent (Lightning's ``model.to(device)``): ``Parked``, in
host memory between calls (``ModelCard.park``), each call bringing the weights to the device and dropping them after;
``SwappedBlocks``, the frozen weights of a model's last blocks in host memory, one block brought to the device at a
time (``Expert.swap_blocks``); ``Unloaded``, a text encoder built on the meta device because its rows come precomputed
(``Expert.precomputed``), which no call may run."""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn


class Parked:
    """A frozen module whose weights live in host memory between calls: each call copies them to ``device`` (and
    the call's tensor arguments there), runs, hands its output back on the device the caller's first tensor came
    from, and drops the device copy, pointing the module back at the host copy (the weights are frozen: nothing
    to copy back). Host copies are pinned on CUDA, so the copy runs at the link's speed. ``calls`` counts the
    calls that brought it to the device."""

    def __init__(self, module: nn.Module, device: torch.device):
        self.device = torch.device(device)
        self.tensors = [*module.parameters(), *module.buffers()]
        self.host = host_copies(self.tensors, self.device)
        self.calls = 0
        self._held = False
        self._home()
        module.register_forward_pre_hook(self._to_device, with_kwargs=True)
        module.register_forward_hook(self._back, always_call=True)
        # the module stays where it is parked when its parent moves (Lightning's `model.to(device)`)
        for sub in module.modules():
            sub._apply = functools.partial(_kept, sub)

    def _home(self) -> None:
        for tensor, host in zip(self.tensors, self.host):
            tensor.data = host

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """On ``device`` for the whole block (many calls, one copy)."""
        for tensor, host in zip(self.tensors, self.host):
            tensor.data = host.to(self.device)
        self._held = True
        try:
            yield
        finally:
            self._held = False
            self._home()

    def _to_device(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        if self._held:
            return None
        self.calls += 1
        self._caller = next((x.device for x in (*args, *kwargs.values()) if torch.is_tensor(x)), self.device)
        for tensor, host in zip(self.tensors, self.host):
            tensor.data = host.to(self.device, non_blocking=True)
        # top-level tensors only: a list argument may be state the module fills in place (a VAE's feature cache)
        move = lambda x: x.to(self.device) if torch.is_tensor(x) else x  # noqa: E731
        return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}

    def _back(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self._held:
            return output
        self._home()
        if isinstance(output, dict):  # a transformers ModelOutput: set in place (it keeps its attributes in step)
            for key, value in output.items():
                output[key] = _moved(value, self._caller)
            return output
        return _moved(output, self._caller)


class SwappedBlocks:
    """The constant tensors of a model's last blocks wait in host memory; a block's forward pre-hook brings them to
    ``device`` and they stay there until ``RESIDENT`` later blocks have come, when they go home (the device copy is
    dropped: they never change, nothing to copy back). ``blocks[i]``: the modules that run as block ``i`` (the expert's
    block and the same block of its frozen copies for roles, whose float8 weights are the expert's);
    ``tensors[i]``: what of them swaps, the frozen base (``ModelCard.swap`` picks it). What trains or is written in
    place (a LoRA adapter; a role copy's adapter, which a sync plan blends) is not swapped and moves with the model.

    Training needs gradient checkpointing (``ModelCard`` refuses it without): backward then runs each block's forward
    again, last block first, so the pre-hook brings the block back before its backward reads the weights; the
    forward's own graph keeps none of them. A block's backward is over once the block before it is recomputed (its
    input gradient is complete only then), so two resident blocks always hold what backward still reads. The last two
    blocks of the forward are still resident when backward starts: ``copies`` after one training forward and backward
    of ``n`` swapped blocks is ``n + (n - 2)``. The copies are ordered on the device's stream (pinned host memory on
    CUDA, ``non_blocking``): correct, and not overlapped with the compute."""

    RESIDENT = 2

    def __init__(self, blocks: list[list[nn.Module]], tensors: list[list[torch.Tensor]], device: torch.device):
        self.device = torch.device(device)
        self.groups = [list({id(t): t for t in group}.values()) for group in tensors]
        self.host = [host_copies(group, self.device) for group in self.groups]
        self.swapped = {id(t) for group in self.groups for t in group}
        self.resident: list[int] = []  # block indices on the device, the oldest first
        self.copies = 0
        for index, same in enumerate(blocks):
            self._home(index)
            for block in same:
                block.register_forward_pre_hook(functools.partial(self._bring, index))
                # what moves the model (Lightning's ``model.to(device)``) moves a block's other tensors only
                for sub in block.modules():
                    sub._apply = functools.partial(_kept_but, sub, self.swapped)

    @property
    def host_bytes(self) -> int:
        """Bytes of the swapped tensors (their host copies)."""
        return sum(_bytes(t) for group in self.host for t in group)

    def _bring(self, index: int, module: nn.Module, args: tuple) -> None:
        if index in self.resident:
            self.resident.remove(index)
        else:
            for tensor, host in zip(self.groups[index], self.host[index]):
                tensor.data = host.to(self.device, non_blocking=True)
            self.copies += 1
        self.resident.append(index)
        while len(self.resident) > self.RESIDENT:
            self._home(self.resident.pop(0))

    def _home(self, index: int) -> None:
        for tensor, host in zip(self.groups[index], self.host[index]):
            tensor.data = host


class Unloaded:
    """A frozen text encoder of expert ``name`` built on the meta device (shapes and dtype, no weights): it stays there
    when its parent moves, and a call to it raises ``error`` (what a meta model would compute is no embedding)."""

    def __init__(self, module: nn.Module, name: str):
        self.name = name
        module.register_forward_pre_hook(self._refuse, with_kwargs=True)
        for sub in module.modules():
            sub._apply = functools.partial(_kept, sub)

    def error(self, prompts: Optional[list[str]] = None) -> ValueError:
        """The error of a call: the prompts (when the caller knows them) whose rows are not cached, and the fix."""
        if prompts is None:
            what = "a call reached it with inputs whose rows are not cached"
        else:
            shown = ", ".join(repr(p if len(p) <= 60 else p[:57] + "...") for p in prompts[:3])
            what = f"{len(prompts)} prompt(s) are not among its rows: {shown}" + (
                f" and {len(prompts) - 3} more" if len(prompts) > 3 else "")
        return ValueError(f"text encoder {self.name!r} is not loaded (precomputed: true: its rows come from `posttrain "
                          f"preprocess`), and {what}. Add them to what `posttrain preprocess` encodes (the data's "
                          f"prompts, a callback's sample prompts) and run it again with --overwrite true, or load the "
                          f"encoder: --model.init_args.card.experts.{self.name}.precomputed false")

    def refuse(self, prompts: list[str]) -> Any:
        """``compute`` of the encoder's cache lookups (``ModelCard.text_embeds``): the prompts that missed, named."""
        raise self.error(prompts)

    def _refuse(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        raise self.error()


def host_copies(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The host copies of ``tensors`` that ``Parked`` and ``SwappedBlocks`` bring to ``device`` (the tensors themselves
    where they already are on the host): pinned for a CUDA device, so the copies run at the link's speed."""
    pin = device.type == "cuda" and torch.cuda.is_available()
    return [t.data.to("cpu").pin_memory() if pin else t.data.to("cpu") for t in tensors]


def _kept(module: nn.Module, fn: Callable, recurse: bool = True) -> nn.Module:
    """``nn.Module._apply`` of a parked or unloaded module: nothing moves it (``Parked`` does; ``Unloaded`` holds
    nothing to move)."""
    return module


def _kept_but(module: nn.Module, keep: set[int], fn: Callable, recurse: bool = True) -> nn.Module:
    """``nn.Module._apply`` of a module inside a swapped block: ``fn`` applies to its tensors but those in ``keep``
    (ids of the swapped ones, which ``SwappedBlocks`` moves)."""
    held = {}
    for table in (module._parameters, module._buffers):
        for key, tensor in table.items():
            if tensor is not None and id(tensor) in keep:
                held[(id(table), key)] = (table, tensor)
                table[key] = None
    try:
        return nn.Module._apply(module, fn, recurse)
    finally:
        for (_, key), (table, tensor) in held.items():
            table[key] = tensor


def _bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds: a quanto float8 weight its data and scale."""
    inner = [getattr(tensor, name) for name in ("_data", "_scale") if torch.is_tensor(getattr(tensor, name, None))]
    return sum(t.numel() * t.element_size() for t in inner) if inner else tensor.numel() * tensor.element_size()


def _moved(value: Any, device: torch.device) -> Any:
    """``value`` with its tensors (at any depth of tuples, lists and dicts) on ``device``."""
    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_moved(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    return value
