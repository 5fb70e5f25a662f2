"""DiffusionNFT: likelihood-free, negative-aware online RL on the forward (noising) process.

Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward Process". Rollouts come
from the ``old`` policy with the plain ODE sampler (any solver; no log-probs), only the clean samples
are kept and scored. The advantage becomes an optimality probability r ∈ [0, 1]; the policy is trained
by flow matching on freshly noised samples through an implicit positive policy (weighted by r) and an
implicit negative one (weighted by 1-r), plus a KL of its velocity to a frozen reference. After each
step ``old`` is decay-blended toward the policy by a sync plan the versions callback runs, so ``old``
has its own version. Math: docs/methods.md#diffusion-nft, ``modules/rl/losses.py``.

    posttrain fit --config configs/diffusion_nft.yaml
"""
from __future__ import annotations

from functools import partial
from typing import Literal, Optional

import torch

from posttrain.lit.base import ExpertModule, RunArgs
from posttrain.modules.io import batch as batch_schema
from posttrain.modules.models.cards import ModelCard
from posttrain.modules.rl.grpo import GRPOArgs, train_rows
from posttrain.modules.rl.losses import nft_loss, nft_old_decay, nft_reward_weight
from posttrain.modules.flow.losses import noised, sample_sigmas
from posttrain.modules.rewards.synthetic import ColourAlignment
from posttrain.modules.rewards.base import Reward, score
from posttrain.modules.rl.rollout import Rollout
from posttrain.modules.flow.samplers import FlowMatchSampler


class DiffusionNFT(ExpertModule):
    """Args:
        card: needs ``transformer`` (trainable), ``vae`` and the generator's text encoders (any generator:
            Wan T2V, FLUX — Flow-GRPO's original setting —, or Wan I2V on batches that carry first frames).
        sampler: the serving sampler (``predict``, validation, sample videos).
        rollout_sampler: the ODE the ``old`` policy rolls out with (any solver: steps, scheduler, CFG);
            None = ``sampler``.
        reward: scores decoded videos against their prompts; None = ``ColourAlignment()``.
        grpo: the group settings NFT shares with GRPO (``num_samples_per_prompt``, ``advantage_std``,
            ``adv_clip`` — also the loss scale —, ``drop_zero_advantage``: a sample with A = 0 has r = ½; a batch
            with none left makes no step and leaves ``old`` where it is); its update is not PPO, so the PPO
            settings are refused.
        beta: β of the implicit positive/negative policies.
        kl_beta: weight of the velocity KL to the frozen reference (NFT's, not the SDE KL of ``grpo.kl_beta``);
            0 adds no reference.
        decay_type: schedule of the ``old`` blend η (0: copy, 1: min(0.001·step, 0.5), 2: delayed).
        num_timesteps: noise levels drawn per sample and update (losses averaged, one optimizer step).
        sigma_min, sigma_max: training σ are uniform in this range, then flow-shifted by ``shift``.
        shift: flow shift of the training σ.
        ema_decay: keep ``transformer_ema``, an EMA of the policy blended after each of its steps, and serve it
            (validation, sample videos, ``predict``) — the reference evaluates and saves its EMA (decay 0.9); None
            serves the policy itself. Apart from ``old``, the behaviour policy, which trails by ``decay_type``.
        run: size of generated videos, seed, NaN tolerance.
    """

    update_runs_rollout_cfg = False  # the update is flow matching on freshly noised samples: one plain forward
    trains_pair = True

    def __init__(self, card: ModelCard, sampler: Optional[FlowMatchSampler] = None,
                 rollout_sampler: Optional[FlowMatchSampler] = None, reward: Optional[Reward] = None,
                 grpo: Optional[GRPOArgs] = None, beta: float = 1.0, kl_beta: float = 1e-4,
                 decay_type: Literal[0, 1, 2] = 1, num_timesteps: int = 2, sigma_min: float = 0.02,
                 sigma_max: float = 0.98, shift: float = 1.0, ema_decay: Optional[float] = None,
                 run: Optional[RunArgs] = None):
        super().__init__(card, sampler, run)
        self.rollout_sampler = rollout_sampler or self.sampler
        self.grpo = grpo or GRPOArgs()
        problems = self.card_problems("diffusion_nft")
        problems += self.grpo.problems("diffusion_nft", unused=("timestep_fraction", "clip_range", "kl_beta",
                                                                 "micro_batch_size", "num_inner_epochs",
                                                                 "num_minibatches"))
        if beta <= 0:
            problems.append(f"beta={beta} must be > 0")
        if kl_beta < 0:
            problems.append(f"kl_beta={kl_beta} must be >= 0")
        if decay_type not in (0, 1, 2):
            problems.append(f"decay_type={decay_type}; choose 0, 1 or 2")
        if num_timesteps < 1:
            problems.append(f"num_timesteps={num_timesteps} must be >= 1")
        if not 0.0 <= sigma_min < sigma_max <= 1.0:
            problems.append(f"sigma_min={sigma_min}, sigma_max={sigma_max}: need 0 <= sigma_min < sigma_max <= 1")
        if ema_decay is not None and not 0.0 < ema_decay < 1.0:
            problems.append(f"ema_decay={ema_decay} must be in (0, 1) (the reference's 0.9; null serves the policy "
                            f"itself)")
        low, high = self.stage.sigma_range(self.policies)
        self.sigma_bounds = (max(low, sigma_min), min(high, sigma_max))  # within the range of the experts that train
        if self.sigma_bounds[0] >= self.sigma_bounds[1] and sigma_min < sigma_max and self.policies:
            problems.append(f"sigma_min={sigma_min}, sigma_max={sigma_max} leave no σ in [{low}, {high}], the range of "
                            f"the trained experts {self.policies} at boundary_ratio={self.card.boundary_ratio}: "
                            f"widen [sigma_min, sigma_max] or train the other expert")
        if problems:
            raise ValueError("diffusion_nft:\n  - " + "\n  - ".join(problems))
        self.reward = reward if reward is not None else ColourAlignment()
        self.beta, self.kl_beta, self.decay_type = beta, kl_beta, decay_type
        self.num_timesteps, self.sigma_min, self.sigma_max, self.shift = num_timesteps, sigma_min, sigma_max, shift
        self.ema_decay = ema_decay
        self.policy = self.stage.transformer
        self.old: Optional[str] = None  # the behaviour policy and the frozen KL anchor, added with the card's roles
        self.reference: Optional[str] = None

    def setup_roles(self) -> None:
        # `old`: the behaviour policy, a copy that trails the policy by the decay blend (a sync plan the
        # versions callback runs after every generator step, bumping `old`'s own version)
        # (a pair of noise experts: each trained expert's copies; running either runs the pair, GeneratorStage.pair_of)
        self.old = self.add_policy_roles("old", partial(nft_old_decay, self.decay_type))
        if self.kl_beta > 0:
            self.reference = self.add_policy_roles("reference")
        self.keep_serving_ema(self.ema_decay)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        prompts = batch_schema.prompts(batch, "diffusion_nft")
        grpo = self.grpo
        K = grpo.num_samples_per_prompt
        # 1. conditioning: each prompt repeated K times (a group, encoded once by the cache)
        group_prompts = [p for p in prompts for _ in range(K)]
        group_ids = batch_schema.group_ids(batch, K)
        # image-to-video: each prompt's first frame (its image, its video's, or its cached latents'), K times
        first = {key: value.repeat_interleave(K, dim=0) for key, value in self.first_frames(batch).items()}
        cond, uncond = self.conditioning(group_prompts, self.rollout_sampler, **first)  # B·K rows

        # 2. roll out K clean samples per prompt from the `old` policy with the ODE sampler
        x0 = Rollout.sample(self.stage, self.rollout_sampler, cond, uncond, self.stage.latent_shape(self.video),
                            self.generator, sde=False, name=self.old).latents  # (B·K, C, F', h, w)

        # 3. decode and score; group advantages → optimality probability r ∈ [0, 1]
        rewards = score(self.reward, self.stage.decode(x0), group_prompts)
        advantages = grpo.advantages(rewards.total, group_ids).to(self.device)
        r = nft_reward_weight(advantages, grpo.adv_clip)

        # 4. positive / implicit-negative flow matching on freshly noised samples (+ reference KL), on the
        #    rows with signal (modules/rl/grpo.py's rule)
        keep = train_rows(advantages, self.any_rank, self.trainer.world_size > 1, grpo.drop_zero_advantage)
        loss = torch.zeros((), device=self.device)
        metrics_seen = []
        if len(keep):
            x0_k, cond_k, r_k = x0[keep], cond.select(keep), r[keep]
            # σ in [sigma_min, sigma_max], within the range of the experts that train (a pair of noise experts)
            low, high = self.sigma_bounds
            timesteps: list[float] = []  # on the host: which experts ran
            for _ in range(self.num_timesteps):
                sigma = low + (high - low) * sample_sigmas(len(keep), "uniform", self.generator, self.shift)
                timesteps += self.sampler.timestep_of(sigma).tolist()
                sigma = sigma.to(self.device)
                noise = torch.randn(x0_k.shape, generator=self.generator).to(x0_k)
                x_t, t = noised(x0_k, noise, sigma), self.sampler.timestep_of(sigma)
                with torch.no_grad():
                    with self.stage.velocity(self.old) as old_fn:
                        v_old = old_fn(x_t, t, cond_k)
                    v_ref = None
                    if self.reference is not None:
                        with self.stage.velocity(self.reference) as ref_fn:
                            v_ref = ref_fn(x_t, t, cond_k)
                with self.stage.velocity(self.policy) as fn:
                    v_theta = fn(x_t, t, cond_k)
                per_sample, metrics = nft_loss(v_theta, v_old, x_t, x0_k, sigma, r_k, self.beta, v_ref,
                                               self.kl_beta, grpo.adv_clip)
                loss = loss + per_sample.mean() / self.num_timesteps
                metrics_seen.append(metrics)
            # 5. one generator step (of each trained expert that ran); the versions callback then blends `old` toward it
            self.step_experts(loss, self.experts_that_ran(timesteps))

        # 6. log
        self.log("train/reward", rewards.total.mean(), prog_bar=True, on_step=True)
        self.log("train/reward_std", rewards.total.std(unbiased=False), on_step=True)
        for name, value in rewards.terms.items():
            self.log(f"train/reward/{name}", value.mean(), on_step=True)
        self.log(f"train/kept_samples/{self.policy}", float(len(keep)), on_step=True)
        self.log(f"train/decay/{self.old}", nft_old_decay(self.decay_type, self.card.versions[self.policies[0]] + 1),
                 on_step=True)
        self.log("train/cache_hit_rate", self.card.cache.hit_rate, on_step=True)
        for key in ("kl", "policy_loss", "positive_loss", "negative_loss"):
            if metrics_seen:
                self.log(f"train/{key}/{self.policy}", torch.stack([m[key] for m in metrics_seen]).mean(),
                         on_step=True)
        self.log(f"train/loss/{self.policy}", loss.detach(), on_step=True)
        return loss.detach()

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """Reward of ODE samples of the policy from fixed noise (seed = batch index)."""
        prompts = list(batch["prompt"])
        videos = self.generate(prompts, seed=batch_idx, **self.first_frames(batch))
        self.log("val/reward", score(self.reward, videos, prompts).total.mean(), prog_bar=True,
                 batch_size=len(prompts), sync_dist=True)
