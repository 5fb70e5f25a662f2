"""FlowGRPO: PPO on the generator's SDE rollouts with group-relative advantages.

Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online RL" (reference code
``flow_grpo/train_sd3.py``). Per prompt, K samples (a group) roll out with the sampler's SDE step,
capturing each step's log p; they are decoded, scored, and each sample's advantage is its reward
normalized within its group. The generator is updated by PPO-clip on a fraction of the steps plus a
KL of the step means to a frozen reference, which carries gradient. One iteration = one rollout batch
and its updates. Math: METHODS.md (flow_grpo), ``modules/rollout.py``, ``modules/losses.py``.

    posttrain fit --config configs/flow_grpo.yaml
"""
from __future__ import annotations

from typing import Literal, Optional

import torch

from posttrain.callbacks.parity import report_rollout
from posttrain.lit.base import ExpertModule, RunArgs
from posttrain.modules.advantages import group_advantages
from posttrain.modules.cards import ModelCard
from posttrain.modules.rewards import ColourAlignment, Reward, score
from posttrain.modules.rollout import c2_gap, mean_metrics, ppo_step_losses, rollout, train_steps
from posttrain.modules.samplers import FlowMatchSampler


class FlowGRPO(ExpertModule):
    """Args:
        card: needs ``transformer`` (trainable), ``vae`` and the generator's text encoders (any generator:
            Wan T2V, FLUX — Flow-GRPO's original setting —, or Wan I2V on batches that carry first frames).
        sampler: the serving sampler; rollouts use it with its SDE step on (``noise_level``,
            ``sde_window``) and ``num_steps`` steps.
        reward: scores decoded videos against their prompts; None = ``ColourAlignment()``.
        num_samples_per_prompt: K, the group size (>= 2: a group of one has no advantage).
        timestep_fraction: share of the SDE steps trained on per minibatch (drawn at random).
        clip_range: PPO's ε.
        kl_beta: weight of the KL to the frozen reference; 0 adds no reference.
        guidance_scale: CFG of rollouts and their recompute (1 = no unconditional pass).
        advantage_std: normalize advantages by the group's std or the whole batch's.
        adv_clip: advantages are clipped to ±adv_clip.
        num_inner_epochs: passes over each rollout batch.
        num_minibatches: minibatches per pass (each one optimizer step).
        micro_batch_size: rows per training forward: each step's loss is computed and backed up in chunks of this
            many samples (gradients accumulate; the update is the same up to float rounding), which bounds the
            activation memory; None = a minibatch at once.
        drop_zero_advantage: leave samples with advantage exactly 0 out of the update; a batch with
            none left makes no optimizer step (a constant reward changes nothing, Adam moments included).
        run: size of generated videos, seed, NaN tolerance.
    """

    def __init__(self, card: ModelCard, sampler: Optional[FlowMatchSampler] = None, reward: Optional[Reward] = None,
                 num_samples_per_prompt: int = 4, timestep_fraction: float = 0.5, clip_range: float = 1e-3,
                 kl_beta: float = 0.004, guidance_scale: float = 1.0,
                 advantage_std: Literal["group", "global"] = "group", adv_clip: float = 5.0,
                 num_inner_epochs: int = 1, num_minibatches: int = 1, drop_zero_advantage: bool = True,
                 micro_batch_size: Optional[int] = None, run: Optional[RunArgs] = None):
        super().__init__(card, sampler, run)
        problems = self.card_problems("flow_grpo")
        if num_samples_per_prompt < 2:
            problems.append(f"num_samples_per_prompt={num_samples_per_prompt} must be >= 2: group advantages "
                            f"compare K samples of one prompt (Flow-GRPO uses 8 to 24)")
        if not 0.0 < timestep_fraction <= 1.0:
            problems.append(f"timestep_fraction={timestep_fraction} must be in (0, 1]")
        if clip_range <= 0:
            problems.append(f"clip_range={clip_range} must be > 0 (PPO's ε; the default is 1e-3)")
        if kl_beta < 0:
            problems.append(f"kl_beta={kl_beta} must be >= 0")
        if num_inner_epochs < 1 or num_minibatches < 1:
            problems.append(f"num_inner_epochs={num_inner_epochs} and num_minibatches={num_minibatches} must be >= 1")
        if micro_batch_size is not None and micro_batch_size < 1:
            problems.append(f"micro_batch_size={micro_batch_size} must be >= 1 (rows per training forward; null: all)")
        if not bool(self.sampler.sde_steps().any()):
            problems.append("the sampler's sde_window holds no step")
        if not self.sampler.euler:
            problems.append(f"SDE rollouts need the Euler flow scheduler (diffusers.FlowMatchEulerDiscreteScheduler), "
                            f"got {type(self.sampler.scheduler).__name__}")
        if problems:
            raise ValueError("flow_grpo:\n  - " + "\n  - ".join(problems))
        self.reward = reward if reward is not None else ColourAlignment()
        self.num_samples_per_prompt = num_samples_per_prompt
        self.timestep_fraction, self.clip_range, self.kl_beta = timestep_fraction, clip_range, kl_beta
        self.guidance_scale = guidance_scale
        self.advantage_std, self.adv_clip = advantage_std, adv_clip
        self.num_inner_epochs, self.num_minibatches = num_inner_epochs, num_minibatches
        self.drop_zero_advantage = drop_zero_advantage
        self.micro_batch_size = micro_batch_size

    def setup_roles(self) -> None:
        if self.kl_beta > 0:  # a LoRA generator's reference is itself with the adapter off (no copy)
            self.card.add_role("reference", of="transformer")

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        prompts = list(batch["prompt"])
        if not prompts:
            raise ValueError("flow_grpo: the batch holds no prompts")
        K = self.num_samples_per_prompt
        # 1. conditioning: each prompt repeated K times (a group); the cache encodes it once.
        #    Group ids are the prompts' dataset indices, the same on every process.
        group_prompts = [p for p in prompts for _ in range(K)]
        group_ids = torch.as_tensor(batch["seed"] if "seed" in batch else batch["index"]).repeat_interleave(K)
        images = self.batch_images(batch)  # image-to-video: each prompt's first frame, None otherwise
        images = images.repeat_interleave(K, dim=0) if images is not None else None
        cond, uncond = self.conditioning(group_prompts, self.guidance_scale, images)  # B·K rows

        # 2. roll out K SDE samples per prompt, capturing x_t and log p of every step
        traj = rollout(self.stage, self.sampler, cond, self.stage.latent_shape(self.video), self.generator,
                       sde=True, uncond=uncond, guidance_scale=self.guidance_scale)

        # 3. decode and score
        videos = self.stage.decode(traj.latents)  # (B·K, 3, F, H, W) in [-1, 1]
        rewards = score(self.reward, videos, group_prompts)

        # 4. group-relative advantages A = clip((r - mean_g) / (std_g + 1e-4), ±5)
        advantages = group_advantages(rewards.total, group_ids, self.advantage_std, self.adv_clip).to(self.device)

        # 5. C2: before any update, callbacks may recompute the stored log p at the rollout's weights
        report_rollout(self, lambda: c2_gap(self.stage, self.sampler, traj, cond, uncond, self.guidance_scale))

        # 6. PPO-clip + KL to the reference, on a fraction of the SDE steps, per minibatch; each step's
        #    loss is backed up before the next step runs (activation memory of one step)
        keep = torch.nonzero(advantages != 0).flatten() if self.drop_zero_advantage \
            else torch.arange(len(advantages), device=self.device)
        if self.trainer.world_size > 1 and self.any_rank(len(keep) > 0):  # a collective: every rank calls it
            # DDP: every rank runs the same backward passes; with signal anywhere each rank trains on all its
            # samples (those with A = 0 add no policy gradient)
            keep = torch.arange(len(advantages), device=self.device)
        reference = "transformer_reference" if self.kl_beta > 0 else None
        metrics: dict[str, list[torch.Tensor]] = {}
        for _ in range(self.num_inner_epochs):
            order = keep[torch.randperm(len(keep), generator=self.generator).to(keep.device)]
            for index in order.chunk(self.num_minibatches) if len(order) else []:
                steps = train_steps(self.sampler, self.timestep_fraction, self.generator)
                self.step_experts(ppo_step_losses(self.stage, self.sampler, traj, steps, cond, advantages,
                                                  self.clip_range, self.kl_beta, uncond, self.guidance_scale,
                                                  index=index, reference=reference, metrics=metrics,
                                                  micro_batch=self.micro_batch_size),
                                  ["transformer"])

        # 7. log
        self.log("train/reward", rewards.total.mean(), prog_bar=True, on_step=True)
        self.log("train/reward_std", rewards.total.std(unbiased=False), on_step=True)
        for name, value in rewards.terms.items():
            self.log(f"train/reward/{name}", value.mean(), on_step=True)
        self.log("train/kept_samples", float(len(keep)), on_step=True)
        self.log("train/cache_hit_rate", self.card.cache.hit_rate, on_step=True)
        for key, value in mean_metrics(metrics).items():
            name = {"ratio_mean": "ppo_ratio_mean"}.get(key, key)
            self.log(f"train/{name}", value, on_step=True)
        return metrics["loss"][-1] if metrics else torch.zeros(())

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """Reward of ODE samples from fixed noise (seed = batch index): comparable across the run."""
        prompts = list(batch["prompt"])
        videos = self.generate(prompts, seed=batch_idx, images=self.batch_images(batch))
        self.log("val/reward", score(self.reward, videos, prompts).total.mean(), prog_bar=True,
                 batch_size=len(prompts))
