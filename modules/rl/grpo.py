"""The GRPO settings every RL method shares, declared, documented and checked once, and the rule for which
rows train.

Group-relative policy optimization (Shao et al. 2024; for flow matching Liu et al. 2025, "Flow-GRPO",
docs/methods.md#flow-grpo): K samples per prompt form a group, each sample's advantage is its reward normalized
within its group (``modules/rl/advantages.py``), and the policy is updated by PPO-clip on a fraction of the
rollout's SDE steps plus a KL to a frozen reference (``modules/rl/rollout.py``). ``flow_grpo`` reads all of it;
``joint_rl`` and ``workflow_rl`` all but the inner epochs and minibatches (one update per rollout batch);
``diffusion_nft`` the group, advantage and row settings (its update is not PPO). A method names the settings it
does not read, and a value set there is refused rather than ignored.

Which rows an update trains on (``train_rows``) is one rule for every method:

- ``drop_zero_advantage``: rows whose advantage is exactly 0 carry no policy gradient (a group whose
  rewards are all equal). On one process they are left out, and an update with none left makes no optimizer
  step at all (a constant reward changes nothing, Adam's moments included).
- Under DDP every process must run the same backward passes (each one all-reduces the gradients), so
  whether to step and on how many rows cannot be decided per process. If any process has a row with A ≠ 0,
  every process trains on all its candidate rows (its A = 0 rows add their KL term only, and every process
  holds the same number of rows, so the same number of micro-batches); if none has, no process steps.
- A refiner's update (joint_rl, workflow_rl: one backward over all its completions) follows the DDP branch on
  one process too: it steps when any process has a row with A ≠ 0, on all its rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional

import torch

from posttrain.modules.rl.advantages import group_advantages
from posttrain.modules.flow.samplers import FlowMatchSampler


@dataclass
class GRPOArgs:
    """Args:
        num_samples_per_prompt: K, the group size (>= 2: a group of one has no advantage).
        timestep_fraction: share of the rollout's SDE steps each update trains on (drawn at random).
        clip_range: PPO's ε.
        kl_beta: weight of the KL of the step means to the frozen reference; 0 adds no reference.
        advantage_std: normalize advantages by the group's std or the whole (gathered) batch's.
        adv_clip: advantages are clipped to ±adv_clip.
        drop_zero_advantage: leave rows with advantage exactly 0 out of the update (the module docstring
            gives the rule, DDP included).
        micro_batch_size: rows per training forward: each step's loss is computed and backed up in chunks of
            this many rows (gradients accumulate; the update is the same up to float rounding), which bounds
            the activation memory; None = all rows at once.
        num_inner_epochs: passes over each rollout batch.
        num_minibatches: minibatches per pass, each one optimizer step.
    """

    num_samples_per_prompt: int = 4
    timestep_fraction: float = 0.5
    clip_range: float = 1e-3
    kl_beta: float = 0.004
    advantage_std: Literal["group", "global"] = "group"
    adv_clip: float = 5.0
    drop_zero_advantage: bool = True
    micro_batch_size: Optional[int] = None
    num_inner_epochs: int = 1
    num_minibatches: int = 1

    def problems(self, method: str, unused: tuple[str, ...] = ()) -> list[str]:
        """Every problem of these settings, each naming ``grpo.<option>`` and the fix; ``unused`` are the
        settings ``method`` does not read (a value other than the default there is a problem too)."""
        problems = []
        if self.num_samples_per_prompt < 2:
            problems.append(f"grpo.num_samples_per_prompt={self.num_samples_per_prompt} must be >= 2: group "
                            f"advantages compare K samples of one prompt (Flow-GRPO uses 8 to 24)")
        if not 0.0 < self.timestep_fraction <= 1.0:
            problems.append(f"grpo.timestep_fraction={self.timestep_fraction} must be in (0, 1]")
        if self.clip_range <= 0:
            problems.append(f"grpo.clip_range={self.clip_range} must be > 0 (PPO's ε; the default is 1e-3)")
        if self.kl_beta < 0:
            problems.append(f"grpo.kl_beta={self.kl_beta} must be >= 0 (0: no KL, no reference)")
        if self.advantage_std not in ("group", "global"):
            problems.append(f"grpo.advantage_std={self.advantage_std!r}; choose 'group' or 'global'")
        if self.adv_clip <= 0:
            problems.append(f"grpo.adv_clip={self.adv_clip} must be > 0")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            problems.append(f"grpo.micro_batch_size={self.micro_batch_size} must be >= 1 (rows per training "
                            f"forward; null: all)")
        if self.num_inner_epochs < 1 or self.num_minibatches < 1:
            problems.append(f"grpo.num_inner_epochs={self.num_inner_epochs} and grpo.num_minibatches="
                            f"{self.num_minibatches} must be >= 1")
        defaults = GRPOArgs()
        for name in unused:
            value = getattr(self, name)
            if value != getattr(defaults, name):
                problems.append(f"grpo.{name}={value!r}: {method} does not use it; remove it")
        return problems

    def advantages(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        """(B,) group-relative advantages of ``rewards`` with these settings (``group_advantages``)."""
        return group_advantages(rewards, group_ids, self.advantage_std, self.adv_clip)


def train_rows(advantages: torch.Tensor, any_rank: Callable[[bool], bool], distributed: bool,
               drop_zero: bool = True, candidates: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The rows of a rollout batch an update trains on (the module docstring's rule); empty: no step.

    Args:
        advantages: (B,) the advantages the update is credited with.
        any_rank: ``flag`` on any process (a collective under DDP; it is called only when ``distributed``).
        distributed: whether several processes train together (DDP).
        drop_zero: leave rows with A = 0 out; False trains on every candidate whatever its advantage.
        candidates: (M,) the rows that may train (e.g. joint_rl's refined samples); None = all B.
    """
    rows = torch.arange(len(advantages), device=advantages.device) if candidates is None else candidates
    if not drop_zero:
        return rows
    signal = rows[advantages[rows] != 0]
    if not distributed:
        return signal
    return rows if any_rank(len(signal) > 0) else signal[:0]


def sde_problems(sampler: FlowMatchSampler, where: str) -> list[str]:
    """Problems of a sampler that rolls out with the SDE step (``where`` names the option)."""
    if not sampler.euler:
        return [f"{where}: SDE rollouts need the Euler flow scheduler (diffusers.FlowMatchEulerDiscreteScheduler), "
                f"got {type(sampler.scheduler).__name__}"]
    if not bool(sampler.sde_steps().any()):
        return [f"{where}: the sampler's sde_window holds no step"]
    return []
