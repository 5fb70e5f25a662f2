"""Group-relative advantages (GRPO; Flow-GRPO, Liu et al. 2025, ``flow_grpo/stat_tracking.py``).

``A = clip((r - mean_group) / (std_group + eps), ±clip)``; the std is the group's or, with
``std="global"``, that of the whole (gathered) batch. Statistics are taken after gathering the rewards
and group ids of every process, so a group split across ranks is normalized as one.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist


def _gather(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(world·B,) concatenation over processes and this rank's offset into it (equal B per rank)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t, 0
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts), dist.get_rank() * t.shape[0]


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, std: Literal["group", "global"] = "group",
                     clip: float = 5.0, eps: float = 1e-4) -> torch.Tensor:
    """(B,) advantages of this process's samples.

    Args:
        rewards: (B,) rewards.
        group_ids: (B,) int ids that name a group across all processes (e.g. the prompt's dataset index).
        std: normalize by the group's std or by the whole batch's.
        clip: advantages are clipped to ±clip.
        eps: added to the std.

    A group whose rewards are all equal gets exactly 0 (not a float residue divided by ``eps``), so a
    constant reward gives zero advantage everywhere.
    """
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must both be (B,)")
    if std not in ("group", "global"):
        raise ValueError(f"std={std!r}; choose 'group' or 'global'")
    all_r, offset = _gather(rewards.detach().to(torch.float64))
    all_g, _ = _gather(group_ids.to(device=rewards.device, dtype=torch.long))
    adv = torch.zeros_like(all_r)
    global_std = all_r.std(unbiased=False) if all_r.numel() > 1 else torch.zeros((), dtype=all_r.dtype)
    for gid in torch.unique(all_g):
        members = all_g == gid
        r = all_r[members]
        if bool((r == r[0]).all()):
            continue  # constant group: zero advantage, exactly
        s = r.std(unbiased=False) if std == "group" else global_std
        adv[members] = (r - r.mean()) / (s + eps)
    adv = adv.clamp(-clip, clip)
    return adv[offset: offset + rewards.shape[0]].to(rewards.dtype if rewards.is_floating_point() else torch.float32)
