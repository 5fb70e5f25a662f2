"""Self-Forcing: a block-causal video student trained on its own chunk-by-chunk rollouts.

Huang et al. 2025, "Self Forcing: Bridging the Train-Test Gap in Autoregressive Video Diffusion" (reference
code ``guandeh17/Self-Forcing``, ``pipeline/self_forcing_training.py`` and ``model/dmd.py``). The student is a
block-causal Wan transformer (``arch: wan_t2v_causal``, ``modules/causal_wan.py``) started from the
bidirectional teacher's weights. It rolls out exactly as it serves: chunk by chunk (``sampler.chunk_frames``
latent frames), each chunk through the few-step list while attending to the finished chunks in a KV cache,
each finished chunk re-run at σ = 0 without grad to fill the cache. One exit step per iteration, drawn from a
generator seeded alike on every process, is the same for every chunk: steps before it run without grad,
its x̂0 keeps grad. So the student trains on its own history (no teacher-forced context), and the loss is
DMD2's on the whole rolled-out video: the frozen bidirectional teacher's CFG score against a critic's, the
critic trained by flow matching on the detached rollouts every iteration, the student every
``generator_update_ratio``-th. Math: METHODS.md (self_forcing, dmd2), ``modules/losses.py``.

    posttrain fit --config configs/self_forcing.yaml
"""
from __future__ import annotations

from typing import Optional

import torch

from posttrain.lit.base import ExpertModule, RunArgs
from posttrain.lit.dmd2 import distillation_problems, log_teacher_gap
from posttrain.modules import presets
from posttrain.modules.cards import ModelCard
from posttrain.modules.losses import dmd_generator_loss, flow_matching_loss, noised, sample_sigmas, x0_from_velocity
from posttrain.modules.samplers import FlowMatchSampler


class SelfForcing(ExpertModule):
    """Args:
        card: needs ``transformer`` (the block-causal student: ``arch: wan_t2v_causal``, trainable), ``critic``
            (the fake score, trainable), ``teacher`` (frozen, bidirectional), ``text_encoder`` and ``vae``;
            student and critic usually start from the teacher (``init_from: teacher``).
        sampler: the student's chunked few-step sampler (``chunk_frames``, ``step_sigmas``, re-noise step); it
            rolls out in training and serves ``predict`` and sample videos.
        teacher_sampler: the teacher's many-step CFG sampler, the target ``validation_step`` compares with;
            None = ``FlowMatchSampler(guidance_scale=guidance_scale)``.
        generator_update_ratio: N; the student steps on iterations 0, N, 2N, … (anchor 5).
        guidance_scale: the teacher's CFG on the real score; the critic has none.
        sigma_range: the σ at which both scores are taken and the critic trains, drawn uniformly from this
            range (anchor 0.02–0.98), then flow-shifted by ``shift``.
        shift: flow shift of those σ.
        run: size of generated videos, seed, NaN tolerance.
    """

    def __init__(self, card: ModelCard, sampler: Optional[FlowMatchSampler] = None,
                 teacher_sampler: Optional[FlowMatchSampler] = None, generator_update_ratio: int = 5,
                 guidance_scale: float = 4.5, sigma_range: tuple[float, float] = (0.02, 0.98), shift: float = 3.0,
                 run: Optional[RunArgs] = None):
        super().__init__(card, sampler, run)
        problems = self.card_problems("self_forcing", trains=("transformer",))
        problems += distillation_problems(self, generator_update_ratio, sigma_range)
        if self.sampler.chunk_frames is None:  # (with chunk_frames set, card_problems checks the arch)
            problems.append("sampler.chunk_frames is not set: self_forcing rolls out chunk by chunk; set it to the "
                            "latent frames per chunk (anchor 3; it must divide the video's latent frames)")
            student = card.specs.get("transformer")
            if student is not None and not hasattr(presets.model_class(student.arch), "new_cache"):
                problems.append(f"`transformer` has arch {student.arch!r}; the self_forcing student is "
                                f"block-causal: set `arch: wan_t2v_causal` (wan_t2v's weights, `init_from: teacher`)")
        if problems:
            raise ValueError("self_forcing:\n  - " + "\n  - ".join(problems))
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

        # 2. the causal rollout, chunk by chunk through the KV cache (the sampler's chunk loop, as served);
        #    one exit step for every chunk, the same on every process; only exit steps carry grad, and only
        #    when the student updates this iteration
        noise = torch.randn((len(prompts), *self.stage.latent_shape(self.video)), generator=self.generator)
        exit_step = int(torch.randint(self.sampler.num_steps, (1,), generator=self.shared_generator))
        with torch.set_grad_enabled(update_student):
            video = self.stage.sample(self.sampler, noise.to(self.device), cond, uncond, name="transformer",
                                      exit_step=exit_step, generator=self.generator).latents  # (B, C, F', h, w)

        # 3. student, every N-th iteration: DMD loss on the whole rolled-out video against the bidirectional
        #    teacher (CFG) and the critic, both without grad
        if update_student:
            sigma = self.score_sigmas(len(prompts))
            x_t = noised(video.detach(), torch.randn(video.shape, generator=self.generator).to(video), sigma)
            t = self.sampler.timestep_of(sigma)
            with torch.no_grad():
                with self.stage.velocity("teacher") as teacher:
                    v_real = self.sampler.velocity(teacher, x_t, t, cond, uncond, self.guidance_scale)
                with self.stage.velocity("critic") as critic:
                    v_fake = critic(x_t, t, cond).float()
            per_sample, metrics = dmd_generator_loss(video, x0_from_velocity(x_t, v_real, sigma),
                                                     x0_from_velocity(x_t, v_fake, sigma))
            self.step_experts(per_sample.mean(), ["transformer"])
            self.log("train/loss/transformer", per_sample.mean().detach(), on_step=True)
            for key, value in metrics.items():
                self.log(f"train/{key}", value, on_step=True)

        # 4. critic, every iteration: flow matching on the detached rollout, target ε - sg(x̂0)
        sample = video.detach()
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
        """Latent MSE of the served (chunked) student to the teacher's many-step CFG sample from the same noise."""
        log_teacher_gap(self, list(batch["prompt"]), batch_idx)

    # ------------------------------------------------------------------ helpers
    def score_sigmas(self, batch_size: int) -> torch.Tensor:
        """(B,) σ ~ U[sigma_range], flow-shifted: where the scores are compared and the critic trains."""
        low, high = self.sigma_range
        return sample_sigmas(batch_size, "uniform", self.generator, self.shift, low=low, high=high).to(self.device)
