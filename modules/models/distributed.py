"""Decisions every process takes together (plain ``torch.distributed``; one process decides alone).

Under DDP every rank must run the same backward passes and collectives, so whether an expert updates, or a
step is skipped, is agreed on before anyone acts: ``any_rank(flag)`` is ``flag`` on at least one process.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def world_size() -> int:
    """Processes in the default group (1 without ``torch.distributed``)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def any_rank(flag: bool, device: Optional[torch.device] = None) -> bool:
    """``flag`` on any process (a collective: every process calls it); ``device`` is where the backend reduces
    (the CUDA device under NCCL)."""
    if world_size() == 1:
        return flag
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)
