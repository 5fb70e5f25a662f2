"""DMD2: distribution-matching distillation of a many-step teacher into a few-step student.

Yin et al. 2024, "Improved Distribution Matching Distillation for Fast Image Synthesis" (reference code
``tianweiy/DMD2``; for flow-matching Wan, Self-Forcing's ``model/dmd.py``). The student samples in a few steps
(``sampler.step_sigmas``, the re-noise step) and stops at a random exit step, whose x̂0 alone carries
gradient (backward simulation). Its sample is noised at a random σ and scored twice: by the frozen teacher
with CFG (the real score) and by a critic (the fake score, no CFG) that keeps learning the student's own
distribution by flow matching on its detached samples. The student moves along ``fake - real``,
normalized per sample. The critic steps every iteration; the student only on every
``generator_update_ratio``-th, and on the others its loss is not computed at all (this is DMD2's
two-time-scale update, not gradient accumulation). Math: METHODS.md (dmd2), ``modules/losses.py``.

    posttrain fit --config configs/dmd2.yaml
"""
from __future__ import annotations

from typing import Optional

import torch

from posttrain.lit.base import ExpertModule, RunArgs
from posttrain.modules.cards import ModelCard
from posttrain.modules.losses import dmd_generator_loss, flow_matching_loss, noised, sample_sigmas, x0_from_velocity
from posttrain.modules.samplers import FlowMatchSampler


class DMD2(ExpertModule):
    """Args:
        card: needs ``transformer`` (the student, trainable), ``critic`` (the fake score, trainable),
            ``teacher`` (frozen, its own source), ``text_encoder`` and ``vae``; student and critic usually
            start from the teacher (``init_from: teacher``).
        sampler: the student's few-step sampler (``step_sigmas``, ``stochastic_sampling`` scheduler); it
            rolls out in training and serves ``predict`` and sample videos.
        teacher_sampler: the teacher's many-step CFG sampler, the target ``validation_step`` compares with;
            None = ``FlowMatchSampler(guidance_scale=guidance_scale)``.
        generator_update_ratio: N; the student steps on iterations 0, N, 2N, … (anchor 5).
        guidance_scale: the teacher's CFG on the real score (anchor 4.5); the critic has none.
        sigma_range: the σ at which both scores are taken and the critic trains, drawn uniformly from this
            range (anchor 0.02–0.98), then flow-shifted by ``shift``.
        shift: flow shift of those σ.
        run: size of generated videos, seed, NaN tolerance.
    """

    method = "dmd2"  # the name start-up problems are reported under

    def __init__(self, card: ModelCard, sampler: Optional[FlowMatchSampler] = None,
                 teacher_sampler: Optional[FlowMatchSampler] = None, generator_update_ratio: int = 5,
                 guidance_scale: float = 4.5, sigma_range: tuple[float, float] = (0.02, 0.98), shift: float = 3.0,
                 run: Optional[RunArgs] = None):
        super().__init__(card, sampler, run)
        problems = self.card_problems(self.method, trains=("transformer",))
        problems += distillation_problems(self, generator_update_ratio, sigma_range)
        problems += self.student_problems(card)
        if problems:
            raise ValueError(f"{self.method}:\n  - " + "\n  - ".join(problems))
        self.teacher_sampler = teacher_sampler or FlowMatchSampler(guidance_scale=guidance_scale)
        self.generator_update_ratio = generator_update_ratio
        self.guidance_scale = guidance_scale
        self.sigma_range, self.shift = tuple(sigma_range), shift

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        prompts = list(batch["prompt"])
        # global_step counts iterations (callbacks.IterationCounter): the student trains on 0, N, 2N, ...
        update_student = self.global_step % self.generator_update_ratio == 0
        # 1. conditioning; the empty prompt's for the teacher's CFG
        cond = self.stage.condition(prompts, self.device)
        uncond = self.stage.condition([""] * len(prompts), self.device)

        # 2. the student's few-step sample x̂0, stopped at a random exit step (the same on every process);
        #    only the exit step has grad, and only when the student updates this iteration
        noise = torch.randn((len(prompts), *self.stage.latent_shape(self.video)), generator=self.generator)
        exit_step = int(torch.randint(self.sampler.num_steps, (1,), generator=self.shared_generator))
        with torch.set_grad_enabled(update_student):
            x0 = self.stage.sample(self.sampler, noise.to(self.device), cond, uncond, name="transformer",
                                   exit_step=exit_step, generator=self.generator).latents

        # 3. student, every N-th iteration: DMD gradient (fake - real) / mean|x̂0 - real| at a random σ;
        #    teacher (CFG) and critic run without grad, the loss reaches the student only
        if update_student:
            sigma = self.score_sigmas(len(prompts))
            x_t = noised(x0.detach(), torch.randn(x0.shape, generator=self.generator).to(x0), sigma)
            t = self.sampler.timestep_of(sigma)
            with torch.no_grad():
                with self.stage.velocity("teacher") as teacher:
                    v_real = self.sampler.velocity(teacher, x_t, t, cond, uncond, self.guidance_scale)
                with self.stage.velocity("critic") as critic:
                    v_fake = critic(x_t, t, cond).float()
            per_sample, metrics = dmd_generator_loss(x0, x0_from_velocity(x_t, v_real, sigma),
                                                     x0_from_velocity(x_t, v_fake, sigma))
            self.step_experts(per_sample.mean(), ["transformer"])
            self.log("train/loss/transformer", per_sample.mean().detach(), on_step=True)
            for key, value in metrics.items():
                self.log(f"train/{key}", value, on_step=True)

        # 4. critic, every iteration: flow matching on the student's detached samples, target ε - sg(x̂0)
        sample = x0.detach()
        sigma = self.score_sigmas(len(prompts))
        eps = torch.randn(sample.shape, generator=self.generator).to(sample)
        with self.stage.velocity("critic") as critic:
            v = critic(noised(sample, eps, sigma), self.sampler.timestep_of(sigma), cond)
        critic_loss = flow_matching_loss(v, sample, eps)[0].mean()
        self.step_experts(critic_loss, ["critic"])

        # 5. log
        self.log("train/loss/critic", critic_loss.detach(), prog_bar=True, on_step=True)
        self.log("train/exit_step", float(exit_step), on_step=True)
        return critic_loss.detach()

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """Latent MSE of the served student to the teacher's many-step CFG sample from the same noise (seed =
        batch index): a cheap proxy of "closer to the teacher", comparable across the run."""
        log_teacher_gap(self, list(batch["prompt"]), batch_idx)

    # ------------------------------------------------------------------ helpers
    def student_problems(self, card: ModelCard) -> list[str]:
        """Start-up problems of the student beyond the card's (a subclass's rollout may need more)."""
        return []

    def score_sigmas(self, batch_size: int) -> torch.Tensor:
        """(B,) σ ~ U[sigma_range], flow-shifted: where the scores are compared and the critic trains."""
        low, high = self.sigma_range
        return sample_sigmas(batch_size, "uniform", self.generator, self.shift, low=low, high=high).to(self.device)


def distillation_problems(module: ExpertModule, generator_update_ratio: int,
                          sigma_range: tuple[float, float]) -> list[str]:
    """Start-up problems shared by the distillation methods (DMD2, Self-Forcing): the critic and the teacher on
    the card, the cadence and σ range."""
    stage = module.stage
    problems = stage.peer_problems("critic", "the fake score", trainable=True,
                                   hint="; add a trainable `critic` expert, e.g. `init_from: teacher`")
    problems += stage.peer_problems("teacher", "the real score", trainable=False,
                                    hint="; add the frozen many-step `teacher` expert (`pretrained:` its weights)")
    if generator_update_ratio < 1:
        problems.append(f"generator_update_ratio={generator_update_ratio} must be >= 1 (the student steps on every "
                        f"N-th iteration; anchor 5)")
    low, high = sigma_range
    if not 0.0 < low < high <= 1.0:
        problems.append(f"sigma_range={tuple(sigma_range)} must satisfy 0 < low < high <= 1 (anchor (0.02, 0.98))")
    return problems


@torch.no_grad()
def log_teacher_gap(module: ExpertModule, prompts: list[str], seed: int) -> None:
    """``val/latent_mse_to_teacher``: the served student's latents vs the teacher's (``module.teacher_sampler``)
    from the same noise."""
    student = module.generate(prompts, seed=seed, latents_only=True)
    noise = torch.randn(student.shape, generator=torch.Generator().manual_seed(seed)).to(module.device)
    cond, uncond = module.conditioning(prompts, module.teacher_sampler.guidance_scale)
    teacher = module.stage.sample(module.teacher_sampler, noise, cond, uncond, name="teacher").latents
    module.log("val/latent_mse_to_teacher", (student - teacher).pow(2).mean(), prog_bar=True,
               batch_size=len(prompts))
