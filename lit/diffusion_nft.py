"""DiffusionNFT: likelihood-free, negative-aware online RL on the forward (noising) process.

Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward Process". Rollouts come
from the ``old`` policy with the plain ODE sampler (any solver; no log-probs), only the clean samples
are kept and scored. The advantage becomes an optimality probability r ∈ [0, 1]; the policy is trained
by flow matching on freshly noised samples through an implicit positive policy (weighted by r) and an
implicit negative one (weighted by 1-r), plus a KL of its velocity to a frozen reference. After each
step ``old`` is decay-blended toward the policy by a sync plan the versions callback runs, so ``old``
has its own version. Math: METHODS.md (diffusion_nft), ``modules/losses.py``.

    posttrain fit --config configs/diffusion_nft.yaml
"""
from __future__ import annotations

from functools import partial
from typing import Literal, Optional

import torch

from posttrain.modules.versions import SyncPlan
from posttrain.lit.base import ExpertModule, RunArgs
from posttrain.modules.advantages import group_advantages
from posttrain.modules.cards import ModelCard
from posttrain.modules.losses import nft_loss, nft_old_decay, nft_reward_weight, noised, sample_sigmas
from posttrain.modules.rewards import ColourAlignment, Reward, score
from posttrain.modules.rollout import rollout
from posttrain.modules.samplers import FlowMatchSampler


class DiffusionNFT(ExpertModule):
    """Args:
        card: needs ``transformer`` (trainable), ``vae`` and the generator's text encoders (any generator:
            Wan T2V, FLUX — Flow-GRPO's original setting —, or Wan I2V on batches that carry first frames).
        sampler: the serving sampler; rollouts use its ODE (``num_steps``, ``shift``, ``guidance_scale``).
        reward: scores decoded videos against their prompts; None = ``ColourAlignment()``.
        num_samples_per_prompt: K, the group size (>= 2).
        beta: β of the implicit positive/negative policies.
        kl_beta: weight of the velocity KL to the frozen reference; 0 adds no reference.
        decay_type: schedule of the ``old`` blend η (0: copy, 1: min(0.001·step, 0.5), 2: delayed).
        num_timesteps: noise levels drawn per sample and update (losses averaged, one optimizer step).
        sigma_min, sigma_max: training σ are uniform in this range, then flow-shifted by ``shift``.
        shift: flow shift of the training σ.
        advantage_std: normalize advantages by the group's std or the whole batch's.
        adv_clip: advantages are clipped to ±adv_clip (also the loss scale).
        drop_zero_advantage: leave samples with advantage exactly 0 (r = ½) out of the update; a batch
            with none left makes no optimizer step and leaves ``old`` where it is.
        run: size of generated videos, seed, NaN tolerance.
    """

    def __init__(self, card: ModelCard, sampler: Optional[FlowMatchSampler] = None, reward: Optional[Reward] = None,
                 num_samples_per_prompt: int = 4, beta: float = 1.0, kl_beta: float = 1e-4,
                 decay_type: Literal[0, 1, 2] = 1, num_timesteps: int = 2, sigma_min: float = 0.02,
                 sigma_max: float = 0.98, shift: float = 1.0, advantage_std: Literal["group", "global"] = "group",
                 adv_clip: float = 5.0, drop_zero_advantage: bool = True, run: Optional[RunArgs] = None):
        super().__init__(card, sampler, run)
        problems = self.card_problems("diffusion_nft")
        if num_samples_per_prompt < 2:
            problems.append(f"num_samples_per_prompt={num_samples_per_prompt} must be >= 2: group advantages "
                            f"compare K samples of one prompt (Flow-GRPO uses 8 to 24)")
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
        if problems:
            raise ValueError("diffusion_nft:\n  - " + "\n  - ".join(problems))
        self.reward = reward if reward is not None else ColourAlignment()
        self.num_samples_per_prompt = num_samples_per_prompt
        self.beta, self.kl_beta, self.decay_type = beta, kl_beta, decay_type
        self.num_timesteps, self.sigma_min, self.sigma_max, self.shift = num_timesteps, sigma_min, sigma_max, shift
        self.advantage_std, self.adv_clip = advantage_std, adv_clip
        self.drop_zero_advantage = drop_zero_advantage

    def setup_roles(self) -> None:
        # `old`: the behaviour policy, a copy that trails the policy by the decay blend (a sync plan the
        # versions callback runs after every generator step, bumping `transformer_old`'s own version)
        old = self.card.add_role("old", of="transformer")
        self.sync_plans.append(SyncPlan("transformer", old, partial(nft_old_decay, self.decay_type)))
        if self.kl_beta > 0:
            self.card.add_role("reference", of="transformer")

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        prompts = list(batch["prompt"])
        if not prompts:
            raise ValueError("diffusion_nft: the batch holds no prompts")
        K = self.num_samples_per_prompt
        # 1. conditioning: each prompt repeated K times (a group, encoded once by the cache)
        group_prompts = [p for p in prompts for _ in range(K)]
        group_ids = torch.as_tensor(batch["seed"] if "seed" in batch else batch["index"]).repeat_interleave(K)
        images = self.batch_images(batch)  # image-to-video: each prompt's first frame, None otherwise
        images = images.repeat_interleave(K, dim=0) if images is not None else None
        cond, uncond = self.conditioning(group_prompts, self.sampler.guidance_scale, images)  # B·K rows

        # 2. roll out K clean samples per prompt from the `old` policy with the ODE sampler
        x0 = rollout(self.stage, self.sampler, cond, self.stage.latent_shape(self.video), self.generator, sde=False,
                     uncond=uncond, name="transformer_old").latents  # (B·K, C, F', h, w)

        # 3. decode and score; group advantages → optimality probability r ∈ [0, 1]
        rewards = score(self.reward, self.stage.decode(x0), group_prompts)
        advantages = group_advantages(rewards.total, group_ids, self.advantage_std, self.adv_clip).to(self.device)
        r = nft_reward_weight(advantages, self.adv_clip)

        # 4. positive / implicit-negative flow matching on freshly noised samples (+ reference KL)
        keep = torch.nonzero(advantages != 0).flatten() if self.drop_zero_advantage \
            else torch.arange(len(advantages), device=self.device)
        if self.trainer.world_size > 1 and self.any_rank(len(keep) > 0):  # a collective: every rank calls it
            # DDP: every rank runs the same backward passes; with signal anywhere each rank trains on all its
            # samples (those with A = 0 add no policy gradient)
            keep = torch.arange(len(advantages), device=self.device)
        loss = torch.zeros((), device=self.device)
        metrics_seen = []
        if len(keep):
            x0_k, cond_k, r_k = x0[keep], cond.select(keep), r[keep]
            for _ in range(self.num_timesteps):
                sigma = sample_sigmas(len(keep), "uniform", self.generator, self.shift).to(self.device)
                sigma = self.sigma_min + (self.sigma_max - self.sigma_min) * sigma
                noise = torch.randn(x0_k.shape, generator=self.generator).to(x0_k)
                x_t, t = noised(x0_k, noise, sigma), self.sampler.timestep_of(sigma)
                with torch.no_grad():
                    with self.stage.velocity("transformer_old") as old_fn:
                        v_old = old_fn(x_t, t, cond_k)
                    v_ref = None
                    if self.kl_beta > 0:
                        with self.stage.velocity("transformer_reference") as ref_fn:
                            v_ref = ref_fn(x_t, t, cond_k)
                with self.stage.velocity("transformer") as fn:
                    v_theta = fn(x_t, t, cond_k)
                per_sample, metrics = nft_loss(v_theta, v_old, x_t, x0_k, sigma, r_k, self.beta, v_ref,
                                               self.kl_beta, self.adv_clip)
                loss = loss + per_sample.mean() / self.num_timesteps
                metrics_seen.append(metrics)
            # 5. one generator step; the versions callback then blends `old` toward the policy
            self.step_experts(loss, ["transformer"])

        # 6. log
        self.log("train/reward", rewards.total.mean(), prog_bar=True, on_step=True)
        self.log("train/reward_std", rewards.total.std(unbiased=False), on_step=True)
        for name, value in rewards.terms.items():
            self.log(f"train/reward/{name}", value.mean(), on_step=True)
        self.log("train/kept_samples", float(len(keep)), on_step=True)
        self.log("train/old_decay", nft_old_decay(self.decay_type, self.card.versions["transformer"] + 1),
                 on_step=True)
        self.log("train/cache_hit_rate", self.card.cache.hit_rate, on_step=True)
        for key in ("kl", "policy_loss", "positive_loss", "negative_loss"):
            if metrics_seen:
                self.log(f"train/{key}", torch.stack([m[key] for m in metrics_seen]).mean(), on_step=True)
        self.log("train/loss", loss.detach(), on_step=True)
        return loss.detach()

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """Reward of ODE samples of the policy from fixed noise (seed = batch index)."""
        prompts = list(batch["prompt"])
        videos = self.generate(prompts, seed=batch_idx, images=self.batch_images(batch))
        self.log("val/reward", score(self.reward, videos, prompts).total.mean(), prog_bar=True,
                 batch_size=len(prompts))
