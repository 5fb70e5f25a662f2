"""FlowGRPO: PPO on the generator's SDE rollouts with group-relative advantages.

Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online RL" (reference code
``flow_grpo/train_sd3.py``). Per prompt, K samples (a group) roll out with the rollout sampler's SDE
step, capturing each step's log p; they are decoded, scored, and each sample's advantage is its reward
normalized within its group. The generator is updated by PPO-clip on a fraction of the steps plus a
KL of the step means to a frozen reference, which carries gradient. One iteration = one rollout batch
and its updates. Math: docs/methods.md#flow-grpo, ``modules/rl/grpo.py`` (the settings, which rows train),
``modules/rl/rollout.py``, ``modules/flow/losses.py``.

    posttrain fit --config configs/flow_grpo.yaml
"""
from __future__ import annotations

from typing import Optional

import torch

from posttrain.callbacks.parity import report_rollout
from posttrain.lit.base import ExpertModule, RunArgs
from posttrain.modules.io import batch as batch_schema
from posttrain.modules.models.cards import ModelCard
from posttrain.modules.rl.grpo import GRPOArgs, sde_problems, train_rows
from posttrain.modules.rewards.synthetic import ColourAlignment
from posttrain.modules.rewards.base import Reward, score
from posttrain.modules.rl.rollout import Rollout, mean_metrics, train_steps
from posttrain.modules.flow.samplers import FlowMatchSampler


class FlowGRPO(ExpertModule):
    """Args:
        card: needs ``transformer`` (trainable), ``vae`` and the generator's text encoders (any generator:
            Wan T2V, FLUX — Flow-GRPO's original setting —, or Wan I2V on batches that carry first frames).
        sampler: the serving sampler (``predict``, validation, sample videos).
        rollout_sampler: what the rollouts run and their recompute reads (its SDE step: ``noise_level``,
            ``sde_window``; its steps and CFG); None = ``sampler`` with its SDE step on (train ≡ serve).
        reward: scores decoded videos against their prompts; None = ``ColourAlignment()``.
        grpo: the GRPO settings (K, timestep fraction, PPO clip, KL, advantages, which rows train, micro-batches,
            inner epochs and minibatches; ``modules.grpo.GRPOArgs``).
        run: size of generated videos, seed, NaN tolerance.
    """

    trains_pair = True

    def __init__(self, card: ModelCard, sampler: Optional[FlowMatchSampler] = None,
                 rollout_sampler: Optional[FlowMatchSampler] = None, reward: Optional[Reward] = None,
                 grpo: Optional[GRPOArgs] = None, run: Optional[RunArgs] = None):
        super().__init__(card, sampler, run)
        self.rollout_sampler = rollout_sampler or self.sampler
        self.grpo = grpo or GRPOArgs()
        problems = self.card_problems("flow_grpo") + self.grpo.problems("flow_grpo")
        problems += sde_problems(self.rollout_sampler, "rollout_sampler" if rollout_sampler else "sampler")
        if problems:
            raise ValueError("flow_grpo:\n  - " + "\n  - ".join(problems))
        self.reward = reward if reward is not None else ColourAlignment()
        self.policy = self.stage.transformer
        self.reference: Optional[str] = None  # the frozen KL anchor, added with the card's roles
        # a pair of noise experts: the rollout schedule's timesteps (on the host) and the SDE steps an update may train
        # on, set with the card's roles (the rollout sampler and the video size are fixed); None: all SDE steps
        self.timesteps: list[float] = []
        self.trainable_steps: Optional[list[int]] = None

    def setup_roles(self) -> None:
        if self.grpo.kl_beta > 0:  # a LoRA generator's reference is itself with the adapter off (no copy)
            # a pair of noise experts: each trained expert's reference (a frozen expert is its own)
            self.reference = self.add_policy_roles("reference")
        if self.stage.transformer_2 is not None:  # some SDE step must be a trained expert's (checked at start-up)
            schedule = self.stage.schedule(self.rollout_sampler, self.stage.latent_shape(self.video))
            self.timesteps = schedule.timesteps.tolist()
            self.trainable_steps = self.trained_steps(schedule.timesteps, self.rollout_sampler.sde_steps())

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        prompts = batch_schema.prompts(batch, "flow_grpo")
        grpo, sampler = self.grpo, self.rollout_sampler
        K = grpo.num_samples_per_prompt
        # 1. conditioning: each prompt repeated K times (a group); the cache encodes it once.
        #    Group keys come with the batch, the same on every process.
        group_prompts = [p for p in prompts for _ in range(K)]
        group_ids = batch_schema.group_ids(batch, K)
        # image-to-video: each prompt's first frame (its image, its video's, or its cached latents'), K times
        first = {key: value.repeat_interleave(K, dim=0) for key, value in self.first_frames(batch).items()}
        cond, uncond = self.conditioning(group_prompts, sampler, **first)  # B·K rows

        # 2. roll out K SDE samples per prompt, capturing x_t and log p of every step
        rollout = Rollout.sample(self.stage, sampler, cond, uncond, self.stage.latent_shape(self.video),
                                 self.generator)

        # 3. decode and score
        videos = self.stage.decode(rollout.latents)  # (B·K, 3, F, H, W) in [-1, 1]
        rewards = score(self.reward, videos, group_prompts)

        # 4. group-relative advantages A = clip((r - mean_g) / (std_g + 1e-4), ±5)
        advantages = grpo.advantages(rewards.total, group_ids).to(self.device)

        # 5. log-probability parity: before any update, callbacks may recompute the stored log p at the rollout's weights
        report_rollout(self, rollout.logprob_gap)

        # 6. PPO-clip + KL to the reference, on a fraction of the SDE steps, per minibatch; each step's
        #    loss is backed up before the next step runs (activation memory of one step). Rows with A = 0
        #    are left out (under DDP: modules/rl/grpo.py's rule)
        keep = train_rows(advantages, self.any_rank, self.trainer.world_size > 1, grpo.drop_zero_advantage)
        metrics: dict[str, list[torch.Tensor]] = {}
        for _ in range(grpo.num_inner_epochs):
            order = keep[torch.randperm(len(keep), generator=self.generator).to(keep.device)]
            for index in order.chunk(grpo.num_minibatches) if len(order) else []:
                # a pair of noise experts: the steps of the experts that train, each step updating its expert
                steps = train_steps(sampler, grpo.timestep_fraction, self.generator, among=self.trainable_steps)
                losses = rollout.select(index).step_losses(steps, advantages[index], grpo.clip_range, grpo.kl_beta,
                                                           self.reference, grpo.micro_batch_size, metrics)
                ran = [self.timesteps[i] for i in steps] if self.timesteps else []  # one generator: all train
                self.step_experts(losses, self.experts_that_ran(ran))

        # 7. log
        self.log("train/reward", rewards.total.mean(), prog_bar=True, on_step=True)
        self.log("train/reward_std", rewards.total.std(unbiased=False), on_step=True)
        for name, value in rewards.terms.items():
            self.log(f"train/reward/{name}", value.mean(), on_step=True)
        self.log(f"train/kept_samples/{self.policy}", float(len(keep)), on_step=True)
        self.log("train/cache_hit_rate", self.card.cache.hit_rate, on_step=True)
        for key, value in mean_metrics(metrics).items():
            self.log(f"train/{key}/{self.policy}", value, on_step=True)
        return metrics["loss"][-1] if metrics else torch.zeros(())

    def trained_steps(self, timesteps: torch.Tensor, sde_mask: torch.Tensor) -> list[int]:
        """The SDE steps (of a schedule's ``timesteps`` and ``sde_mask``) an update on a pair of noise experts may
        train on: those a trainable expert runs."""
        steps = [i for i in torch.nonzero(sde_mask).flatten().tolist()
                 if self.stage.expert_at(float(timesteps[i])) in self.policies]
        if not steps:
            raise ValueError(f"flow_grpo: no SDE step of the rollout sampler (timesteps "
                             f"{[round(float(t), 1) for t in timesteps]}, sde_window {self.rollout_sampler.sde_window})"
                             f" is in the range of the trained experts {self.policies} at boundary_ratio="
                             f"{self.card.boundary_ratio}: widen sde_window or train the other expert")
        return steps

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """Reward of ODE samples from fixed noise (seed = batch index): comparable across the run."""
        prompts = list(batch["prompt"])
        videos = self.generate(prompts, seed=batch_idx, **self.first_frames(batch))
        self.log("val/reward", score(self.reward, videos, prompts).total.mean(), prog_bar=True,
                 batch_size=len(prompts), sync_dist=True)
