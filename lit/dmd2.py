"""DMD2: distribution-matching distillation of a many-step teacher into a few-step student, and Self-Forcing.

Yin et al. 2024, "Improved Distribution Matching Distillation for Fast Image Synthesis" (reference code
``tianweiy/DMD2``; for flow-matching Wan, Self-Forcing's ``model/dmd.py``). The student samples in a few steps
(``sampler.step_sigmas``, the re-noise step) and stops at a random exit step, whose x̂0 alone carries
gradient (backward simulation). Its sample is noised at a random σ and scored twice: by the frozen teacher
with CFG (the real score) and by a critic (the fake score, no CFG) that keeps learning the student's own
distribution by flow matching on its detached samples. The student moves along ``fake - real``,
normalized per sample. The critic steps every iteration; the student only on every
``generator_update_ratio``-th, and on the others its loss is not computed at all (this is DMD2's
two-time-scale update, not gradient accumulation). Math: METHODS.md (dmd2), ``modules/losses.py``.

**Self-Forcing** (Huang et al. 2025, "Self Forcing: Bridging the Train-Test Gap in Autoregressive Video
Diffusion", reference ``guandeh17/Self-Forcing``, ``pipeline/self_forcing_training.py``; METHODS.md
self_forcing) is this algorithm with a block-causal student (``arch: wan_t2v_causal``, ``modules/causal_wan.py``,
started from the bidirectional teacher's weights) and a sampler that rolls it out chunk by chunk
(``sampler.chunk_frames``): each chunk through the few-step list while attending to the finished chunks in a KV
cache, each finished chunk re-run at σ = 0 without grad to fill the cache, the exit step (drawn alike on every
process) the same for every chunk. The student then trains on its own history, exactly as it serves; the losses
and the cadence are DMD2's on the whole rolled-out video. Both differences are configuration (the card's arch and
the sampler), so Self-Forcing is ``configs/self_forcing.yaml``, not a second class with a copy of this step.

    posttrain fit --config configs/dmd2.yaml
    posttrain fit --config configs/self_forcing.yaml
"""
from __future__ import annotations

from typing import Optional

import torch

from posttrain.lit.base import ExpertModule, RunArgs
from posttrain.modules.cards import ModelCard
from posttrain.modules.losses import dmd_generator_loss, flow_matching_loss, noised, sample_sigmas, x0_from_velocity
from posttrain.modules.samplers import FlowMatchSampler

TEACHER_CFG = 4.5  # DMD2's anchor guidance of the real score: the default teacher sampler's


class DMD2(ExpertModule):
    """Args:
        card: needs ``transformer`` (the student, trainable; block-causal for Self-Forcing), ``critic`` (the fake
            score, trainable), ``teacher`` (frozen, its own source), ``text_encoder`` and ``vae``; student and
            critic usually start from the teacher (``init_from: teacher``).
        sampler: the student's few-step sampler (``step_sigmas``, ``stochastic_sampling`` scheduler; with
            ``chunk_frames``, chunk by chunk: Self-Forcing); it rolls out in training and serves ``predict`` and
            sample videos.
        teacher_sampler: the teacher's: its CFG scale guides the real score (the critic has none), and its many
            steps make the target ``validation_step`` compares with; None = ``FlowMatchSampler`` with
            ``TEACHER_CFG``.
        generator_update_ratio: N; the student steps on iterations 0, N, 2N, … (anchor 5).
        sigma_range: the σ at which both scores are taken and the critic trains, drawn uniformly from this
            range (anchor 0.02–0.98), then flow-shifted by ``shift``.
        shift: flow shift of those σ.
        run: size of generated videos, seed, NaN tolerance.
    """

    def __init__(self, card: ModelCard, sampler: Optional[FlowMatchSampler] = None,
                 teacher_sampler: Optional[FlowMatchSampler] = None, generator_update_ratio: int = 5,
                 sigma_range: tuple[float, float] = (0.02, 0.98), shift: float = 3.0, run: Optional[RunArgs] = None):
        super().__init__(card, sampler, run)
        self.student, self.critic, self.teacher = self.stage.transformer, "critic", "teacher"
        problems = self.card_problems("dmd2", trains=(self.student,))
        problems += self.stage.peer_problems(self.critic, "the fake score", trainable=True,
                                             hint="; add a trainable `critic` expert, e.g. `init_from: teacher`")
        problems += self.stage.peer_problems(self.teacher, "the real score", trainable=False,
                                             hint="; add the frozen many-step `teacher` expert (`pretrained:` its "
                                                  "weights)")
        if generator_update_ratio < 1:
            problems.append(f"generator_update_ratio={generator_update_ratio} must be >= 1 (the student steps on "
                            f"every N-th iteration; anchor 5)")
        low, high = sigma_range
        if not 0.0 < low < high <= 1.0:
            problems.append(f"sigma_range={tuple(sigma_range)} must satisfy 0 < low < high <= 1 (anchor (0.02, 0.98))")
        if problems:
            raise ValueError("dmd2:\n  - " + "\n  - ".join(problems))
        self.teacher_sampler = teacher_sampler or FlowMatchSampler(guidance_scale=TEACHER_CFG)
        self.generator_update_ratio = generator_update_ratio
        self.sigma_range, self.shift = tuple(sigma_range), shift

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        prompts = list(batch["prompt"])
        # global_step counts iterations (callbacks.IterationCounter): the student trains on 0, N, 2N, ...
        update_student = self.global_step % self.generator_update_ratio == 0
        # 1. conditioning; the empty prompt's for the teacher's CFG
        cond = self.stage.condition(prompts, self.device)
        uncond = self.stage.condition([""] * len(prompts), self.device)

        # 2. the student's few-step sample x̂0 (chunk by chunk for a block-causal student), stopped at a random exit
        #    step (the same on every process); only the exit step has grad, and only when the student updates
        noise = torch.randn((len(prompts), *self.stage.latent_shape(self.video)), generator=self.generator)
        exit_step = int(torch.randint(self.sampler.num_steps, (1,), generator=self.shared_generator))
        with torch.set_grad_enabled(update_student):
            x0 = self.stage.sample(self.sampler, noise.to(self.device), cond, uncond, name=self.student,
                                   exit_step=exit_step, rng=self.generator).latents

        # 3. student, every N-th iteration: DMD gradient (fake - real) / mean|x̂0 - real| at a random σ;
        #    teacher (its sampler's CFG) and critic run without grad, the loss reaches the student only
        if update_student:
            sigma = self.score_sigmas(len(prompts))
            x_t = noised(x0.detach(), torch.randn(x0.shape, generator=self.generator).to(x0), sigma)
            t = self.sampler.timestep_of(sigma)
            with torch.no_grad():
                with self.stage.velocity(self.teacher) as teacher:
                    v_real = self.teacher_sampler.velocity(teacher, x_t, t, cond, uncond)
                with self.stage.velocity(self.critic) as critic:
                    v_fake = critic(x_t, t, cond).float()
            per_sample, metrics = dmd_generator_loss(x0, x0_from_velocity(x_t, v_real, sigma),
                                                     x0_from_velocity(x_t, v_fake, sigma))
            self.step_experts(per_sample.mean(), [self.student])
            self.log(f"train/loss/{self.student}", per_sample.mean().detach(), on_step=True)
            for key, value in metrics.items():
                self.log(f"train/{key}/{self.student}", value, on_step=True)

        # 4. critic, every iteration: flow matching on the student's detached samples, target ε - sg(x̂0)
        sample = x0.detach()
        sigma = self.score_sigmas(len(prompts))
        eps = torch.randn(sample.shape, generator=self.generator).to(sample)
        with self.stage.velocity(self.critic) as critic:
            v = critic(noised(sample, eps, sigma), self.sampler.timestep_of(sigma), cond)
        critic_loss = flow_matching_loss(v, sample, eps)[0].mean()
        self.step_experts(critic_loss, [self.critic])

        # 5. log
        self.log(f"train/loss/{self.critic}", critic_loss.detach(), prog_bar=True, on_step=True)
        self.log("train/exit_step", float(exit_step), on_step=True)
        return critic_loss.detach()

    @torch.no_grad()
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """Latent MSE of the served student to the teacher's many-step CFG sample from the same noise (seed =
        batch index): a cheap proxy of "closer to the teacher", comparable across the run."""
        prompts = list(batch["prompt"])
        student = self.generate(prompts, seed=batch_idx, latents_only=True)
        noise = torch.randn(student.shape, generator=torch.Generator().manual_seed(batch_idx)).to(self.device)
        cond, uncond = self.conditioning(prompts, self.teacher_sampler)
        teacher = self.stage.sample(self.teacher_sampler, noise, cond, uncond, name=self.teacher).latents
        self.log("val/latent_mse_to_teacher", (student - teacher).pow(2).mean(), prog_bar=True,
                 batch_size=len(prompts))

    # ------------------------------------------------------------------ helpers
    def score_sigmas(self, batch_size: int) -> torch.Tensor:
        """(B,) σ ~ U[sigma_range], flow-shifted: where the scores are compared and the critic trains."""
        low, high = self.sigma_range
        return sample_sigmas(batch_size, "uniform", self.generator, self.shift, low=low, high=high).to(self.device)
