"""Flow-matching finetuning of the generator on captioned videos (or images).

Regress the transformer's velocity onto ``ε - x0`` at a random noise level σ (rectified flow; Esser
et al. 2024, "Scaling Rectified Flow Transformers", logit-normal σ as in SD3/Wan training), with
conditioning from the frozen text encoders (cached by prompt hash and encoder version) and, for an
image-to-video generator, from each video's own first frame (Wan I2V's training setup; Wan 2.2 TI2V also from
precomputed latents, their first latent frame: ``ExpertModule.condition_batch``). Any generator
of ``modules/models/generators/``: Wan T2V on videos, FLUX on images (one-frame videos), Wan I2V on videos.
Optional EMA of the generator, kept by a sync plan and used for sampling.

    posttrain fit --config configs/finetune.yaml          # Wan T2V
    posttrain fit --config configs/finetune_flux.yaml     # FLUX text-to-image
    posttrain fit --config configs/finetune_i2v.yaml      # Wan image-to-video
"""
from __future__ import annotations

from typing import Literal, Optional

import torch

from posttrain.lit.base import ExpertModule, RunArgs
from posttrain.modules.models.cards import ModelCard
from posttrain.modules.models.generators import VideoSize
from posttrain.modules.flow.losses import flow_matching_loss, noised, sample_sigmas
from posttrain.modules.flow.samplers import FlowMatchSampler


class Finetune(ExpertModule):
    """Args:
        card: needs ``transformer`` (trainable), ``vae`` and the generator's text encoders
            (``text_encoder``; FLUX also ``text_encoder_2``). A pair of noise experts (``transformer``,
            ``transformer_2``, the card's ``boundary_ratio``) trains whichever of the two are trainable, each on
            the rows whose noise level is in its range; with one of them trainable σ is drawn in its range.
        sigma_sampling: how training noise levels are drawn.
        shift: flow shift applied to the drawn σ.
        logit_mean, logit_std: parameters of the logit-normal σ.
        caption_dropout: probability of training on the empty prompt (what CFG needs at sampling).
        ema_decay: keep ``transformer_ema`` with this decay per generator step; None keeps none.
        val_sigmas: fixed noise levels of the validation loss.
        run: size of generated videos, seed, NaN tolerance.
    """

    trains_pair = True

    def __init__(self, card: ModelCard, sampler: Optional[FlowMatchSampler] = None,
                 sigma_sampling: Literal["uniform", "logit_normal"] = "logit_normal", shift: float = 1.0,
                 logit_mean: float = 0.0, logit_std: float = 1.0, caption_dropout: float = 0.1,
                 ema_decay: Optional[float] = None, val_sigmas: tuple[float, ...] = (0.25, 0.5, 0.75),
                 run: Optional[RunArgs] = None):
        super().__init__(card, sampler, run)
        problems = self.card_problems("finetune")
        if not 0.0 <= caption_dropout < 1.0:
            problems.append(f"caption_dropout={caption_dropout} must be in [0, 1) (e.g. 0.1; 0 keeps every caption)")
        if ema_decay is not None and not 0.0 < ema_decay < 1.0:
            problems.append(f"ema_decay={ema_decay} must be in (0, 1) (e.g. 0.999; null turns EMA off)")
        if problems:
            raise ValueError("finetune:\n  - " + "\n  - ".join(problems))
        self.sigma_sampling, self.shift = sigma_sampling, shift
        self.logit_mean, self.logit_std = logit_mean, logit_std
        self.caption_dropout = caption_dropout
        self.ema_decay = ema_decay
        self.val_sigmas = val_sigmas
        self.policy = self.stage.transformer
        # [low, high] of σ before the flow shift: all of [0, 1], or, where one expert of a pair of noise experts
        # trains, its range (shift(σ) = t / num_train_timesteps on its side of ``boundary_ratio``) unshifted, so every
        # row trains it (the drawn distribution mapped onto the range, as ``sample_sigmas`` maps it). σ = σ' / (s -
        # (s - 1)·σ') inverts σ' = sσ / (1 + (s - 1)σ) and keeps 0 and 1 exact (``shift_sigmas(σ', 1 / s)`` does not)
        self.unshifted_sigma_range = tuple(s / (shift - (shift - 1) * s)
                                           for s in self.stage.sigma_range(self.policies))

    def setup_roles(self) -> None:
        self.keep_serving_ema(self.ema_decay)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        # 1. clean latents x0 (B, C, F', h, w): precomputed by the datamodule, or the frozen VAE's
        x0 = self.latents(batch)
        # 2. conditioning; a fraction of captions is dropped to the empty prompt for CFG (an image-to-video
        #    generator keeps its first frame: the pipelines' negative pass swaps only the text)
        prompts = list(batch["prompt"])
        drop = torch.rand(len(prompts), generator=self.generator) < self.caption_dropout
        prompts = ["" if d else p for p, d in zip(prompts, drop.tolist())]
        cond = self.condition_batch(batch, prompts, self.size_of(batch))
        # 3. noise level σ and noise ε; x_σ = (1-σ)·x0 + σ·ε; the experts that step: of a pair, each trained expert
        #    that runs a row on any process (read from σ on the host; every process steps the same experts)
        sigma = sample_sigmas(x0.shape[0], self.sigma_sampling, self.generator, self.shift,
                              self.logit_mean, self.logit_std, *self.unshifted_sigma_range)
        stepping = self.experts_that_ran(self.sampler.timestep_of(sigma).tolist())
        sigma = sigma.to(self.device)
        noise = torch.randn(x0.shape, generator=self.generator).to(x0)
        # 4. v_θ(x_σ, σ, c) regressed onto ε - x0
        with self.stage.velocity(self.policy) as velocity:
            v = velocity(noised(x0, noise, sigma), self.sampler.timestep_of(sigma), cond)
        per_sample, metrics = flow_matching_loss(v, x0, noise)
        loss = per_sample.mean()
        # 5. one backward, one step of each generator expert that ran
        self.step_experts(loss, stepping)
        self.log(f"train/loss/{self.policy}", loss, prog_bar=True, on_step=True)
        self.log("train/cache_hit_rate", self.card.cache.hit_rate, on_step=True)
        return loss.detach()

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """Flow-matching loss at fixed σ with fixed noise: comparable across the run."""
        x0 = self.latents(batch)
        cond = self.condition_batch(batch, list(batch["prompt"]), self.size_of(batch))
        g = torch.Generator().manual_seed(batch_idx)
        losses = []
        with self.stage.velocity(self.serving_transformer) as velocity:
            for s in self.val_sigmas:
                noise = torch.randn(x0.shape, generator=g).to(x0)
                sigma = torch.full((x0.shape[0],), s, device=self.device)
                v = velocity(noised(x0, noise, sigma), self.sampler.timestep_of(sigma), cond)
                losses.append(flow_matching_loss(v, x0, noise)[0].mean())
        self.log("val/loss", torch.stack(losses).mean(), prog_bar=True, batch_size=x0.shape[0], sync_dist=True)

    def latents(self, batch: dict) -> torch.Tensor:
        """(B, C, F', h, w) the clean latents it trains on: the datamodule's, or the VAE's of the batch's videos."""
        return self.batch_latents(batch, "finetune trains on the batch's clips")

    def size_of(self, batch: dict):
        """The pixel size of the batch's videos (what an image-to-video conditioning is built for)."""
        if "video" not in batch:
            return self.video
        _, _, frames, height, width = batch["video"].shape
        return VideoSize(frames, height, width)
