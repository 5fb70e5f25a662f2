"""DMD2: distribution-matching distillation of a many-step teacher into a few-step student, and Self-Forcing.

Yin et al. 2024, "Improved Distribution Matching Distillation for Fast Image Synthesis" (reference code
``tianweiy/DMD2``; for flow-matching Wan, Self-Forcing's ``model/dmd.py``). The student samples in
``student_steps`` steps (the re-noise step) and stops at a random exit step, whose x̂0 alone carries gradient; the
steps before it are its own rollout from noise (backward simulation; ``backward_simulation: false`` feeds the exit
step a noised teacher sample instead). Its sample is noised at a random σ and scored twice: by the frozen teacher
with CFG (the real score) and by a critic (the fake score, no CFG) that keeps learning the student's own
distribution by flow matching on its detached samples. The student moves along ``fake - real``,
normalized per sample. The critic steps every iteration; the student only on every
``generator_update_ratio``-th, and on the others its loss is not computed at all (this is DMD2's
two-time-scale update, not gradient accumulation). With ``gan.critic_weight`` > 0, DMD2's GAN term: a small head
on the critic's last-block features (``modules/distill/gan.py``) learns teacher samples (real; ``gan.reals: data``:
the batch's own clips, DMD2's real images) from the student's (fake), both noised, in the critic's update, and the
student adds the non-saturating loss of its x̂0 through the frozen critic and head (``gan.generator_weight``;
``gan.space: pixels``: the head is a patch discriminator on the VAE-decoded clips instead);
``train/gan_to_dmd_grad`` logs that term's pull on x̂0 against DMD's (their gradient norms there, weights included:
whether the GAN term does anything at the weights given). With ``regression.weight`` > 0, the first DMD's
regression loss: the student's first step maps a teacher pair's noise to the teacher's sample from it (both terms'
settings: ``modules/distill/args.py``). An image-to-video student, critic and teacher (``wan22_ti2v_i2v``,
``wan_i2v``) read each row's first frame from the batch (``first_frames``): every rollout, score, critic update and
teacher sample is conditioned on it (``configs/dmd2_wan22_ti2v.yaml``). Math: docs/methods.md#dmd2,
``modules/distill/losses.py``.

**Self-Forcing** (Huang et al. 2025, "Self Forcing: Bridging the Train-Test Gap in Autoregressive Video Diffusion",
reference ``guandeh17/Self-Forcing``, ``pipeline/self_forcing_training.py``; docs/methods.md#self-forcing) is this
algorithm with a block-causal student (``arch: wan_t2v_causal``, ``modules/models/causal_wan.py``, started from the
bidirectional teacher's weights) and a sampler that rolls it out chunk by chunk (``sampler.chunk_frames``): each
chunk through the few-step list while attending to the finished chunks in a KV cache, each finished chunk re-run at
σ = 0 without grad to fill the cache, the exit step (drawn alike on every process) the same for every chunk. The
student then trains on its own history, exactly as it serves; the losses and the cadence are DMD2's on the whole
rolled-out video. Both differences are configuration (the card's arch and the sampler), so Self-Forcing is
``configs/self_forcing.yaml``, not a second class with a copy of this step.

    posttrain fit --config configs/dmd2.yaml
    posttrain fit --config configs/self_forcing.yaml
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Literal, Optional

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from posttrain.lit.base import ExpertModule, RunArgs
from posttrain.modules.models.cards import ModelCard
from posttrain.modules.flow.conditioning import Conditioning
from posttrain.modules.distill.args import GANArgs, RegressionArgs
from posttrain.modules.distill.gan import HEAD, attach_head, block_features, frozen, pooled_text, tapped
from posttrain.modules.distill.losses import dmd_generator_loss, gan_critic_loss, gan_generator_loss
from posttrain.modules.flow.losses import flow_matching_loss, noised, sample_sigmas, x0_from_velocity
from posttrain.modules.flow.samplers import FlowMatchSampler

TEACHER_CFG = 4.5  # DMD2's anchor guidance of the real score: the default teacher sampler's


class DMD2(ExpertModule):
    """Args:
        card: needs ``transformer`` (the student, trainable; block-causal for Self-Forcing), ``critic`` (the fake
            score, trainable), ``teacher`` (frozen, its own source), ``text_encoder`` and ``vae``; student and
            critic usually start from the teacher (``init_from: teacher``). A pair of noise experts is a teacher only
            (``teacher``, ``teacher_2`` with the card's ``boundary_ratio``); a student pair is refused.
        sampler: the student's sampler (its scheduler, e.g. ``stochastic_sampling``; with ``chunk_frames``, chunk
            by chunk: Self-Forcing); it rolls out in training and serves ``predict`` and sample videos. Its steps
            are ``student_steps``'; None = the re-noising Euler scheduler with shift 3.
        student_steps: n, the student's sampling steps; its step list is σ ∈ {1, (n-1)/n, …, 1/n} before the
            scheduler's flow shift (4: {1, .75, .5, .25}, DMD2's and Self-Forcing's; 2: {1, .5}; 1: {1}). A
            sampler that lists ``step_sigmas`` itself must list n of them.
        backward_simulation: the input of the student's exit step k is its own rollout from noise through steps
            0…k-1 (DMD2's backward simulation, as it serves); False = a teacher sample noised to σ_k (DMD2
            without it: the student then trains on inputs it never meets when it serves).
        exit_steps: which of the student's steps the DMD and GAN terms score (and the critic learns from):
            ``random`` (DMD2's and Self-Forcing's: one drawn each iteration, so every step's x̂0 is pushed toward
            the teacher's distribution) or ``last`` (the served sample alone: the steps before it are only its
            rollout, shaped by the regression term where it is on).
        teacher_sampler: the teacher's: its CFG scale guides the real score (the critic has none), and its many
            steps make the target ``validation_step`` compares with and the GAN's real samples; None =
            ``FlowMatchSampler`` with ``TEACHER_CFG``.
        generator_update_ratio: N; the student steps on iterations 0, N, 2N, … (anchor 5).
        sigma_range: the σ at which both scores are taken and the critic (and the GAN head) trains, drawn
            uniformly from this range (anchor 0.02–0.98), then flow-shifted by ``shift``.
        shift: flow shift of those σ.
        gan: DMD2's GAN term (``GANArgs``: its two weights, the critic's blocks the head reads, whether it looks at
            the critic's features or the decoded clips, what it learns as real); None = off.
        regression: the first DMD's regression onto teacher pairs (``RegressionArgs``: its weight, pairs per
            prompt, which of the student's steps regress, a warm-up); None = off.
        ema_decay: keep ``transformer_ema``, an EMA of the student with this decay per student step, and serve it
            (samples, validation, ``predict``; Self-Forcing's ``ema_weight``, anchor 0.99); None keeps none.
        real_guidance_scale: the CFG scale of the real score (DMD2's ``real_guidance_scale``); None = the teacher
            sampler's, which still makes the teacher's samples (regression pairs, GAN reals, validation target).
        real_guidance_rescale: φ of CFG rescale on the real score (the sampler's ``guidance_rescale``, Lin et al.
            2023, anchor 0.7); None = the teacher sampler's (0 unless it sets one).
        real_guidance_interval: (low, high): the real score guided only where the comparison's σ lies in
            [low, high], the teacher's conditional score elsewhere (guidance in a limited interval, Kynkäänniemi
            et al. 2024: CFG at high noise drifts from the data, at low noise it only saturates; their EDM2 interval
            is σ_flow ≈ (0.22, 0.84]); None guides at every σ.
        run: size of generated videos, seed, NaN tolerance.
    """

    def __init__(self, card: ModelCard, sampler: Optional[FlowMatchSampler] = None, student_steps: int = 4,
                 backward_simulation: bool = True, exit_steps: Literal["random", "last"] = "random",
                 teacher_sampler: Optional[FlowMatchSampler] = None,
                 generator_update_ratio: int = 5, sigma_range: tuple[float, float] = (0.02, 0.98), shift: float = 3.0,
                 gan: Optional[GANArgs] = None, regression: Optional[RegressionArgs] = None,
                 ema_decay: Optional[float] = None,
                 real_guidance_scale: Optional[float] = None, real_guidance_rescale: Optional[float] = None,
                 real_guidance_interval: Optional[tuple[float, float]] = None,
                 run: Optional[RunArgs] = None):
        sampler = sampler or FlowMatchSampler(
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, stochastic_sampling=True))
        problems = student_steps_problems(sampler, student_steps)
        if not problems and sampler.step_sigmas is None:
            sampler = student_sampler(sampler, student_steps)
        super().__init__(card, sampler, run)
        self.student, self.critic, self.teacher = self.stage.transformer, "critic", "teacher"
        self.gan, self.regression = gan or GANArgs(), regression or RegressionArgs()
        problems += self._problems(backward_simulation, exit_steps, generator_update_ratio, sigma_range, ema_decay,
                                   real_guidance_scale, real_guidance_rescale, real_guidance_interval)
        if problems:
            raise ValueError("dmd2:\n  - " + "\n  - ".join(problems))
        self.teacher_sampler = teacher_sampler or FlowMatchSampler(guidance_scale=TEACHER_CFG)
        self.backward_simulation, self.exit_steps = backward_simulation, exit_steps
        self.generator_update_ratio = generator_update_ratio
        self.sigma_range, self.shift = tuple(sigma_range), shift
        self.ema_decay = ema_decay
        self.real_guidance_scale, self.real_guidance_rescale = real_guidance_scale, real_guidance_rescale
        self.real_guidance_interval = tuple(real_guidance_interval) if real_guidance_interval is not None else None
        # (prompt, j, first frame's digest) -> the teacher's (noise, sample), each (C, F, h, w): see teacher_pairs
        self._teacher_bank: dict[tuple[str, int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def critic_gan(self) -> bool:  # the GAN head reads the critic's features (the student's GAN loss through it)
        return self.gan.enabled and self.gan.space == "critic"

    def setup_roles(self) -> None:
        super().setup_roles()
        if self.gan.enabled:  # the head is part of the critic: its optimizer, checkpoint entry and versions
            attach_head(self.card.models[self.critic], seed=self.run.seed, blocks=self.gan.blocks,
                        space=self.gan.space)
        self.keep_serving_ema(self.ema_decay)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        prompts = list(batch["prompt"])
        # global_step counts iterations (callbacks.IterationCounter): the student trains on 0, N, 2N, ...
        update_student = self.global_step % self.generator_update_ratio == 0
        # 1. conditioning; the empty prompt's for the teacher's CFG. Image-to-video: both hold each row's first frame
        #    (its image, its video's, or its cached latents'), which every score and sample below then reads
        first = self.first_frames(batch)
        cond, uncond = self.stage.conditioning(prompts, None, self.device, size=self.video, **first)
        # the GAN head's real samples when they are the data's (first: data without clips fails before any step)
        data_reals = self.data_reals(batch) if self.gan.enabled and self.gan.reals == "data" else None

        # 2. the student's few-step sample x̂0, stopped at a random exit step k (the same on every process; the last
        #    with exit_steps: last); only step k has grad, and only when the student updates. Step k's input: with
        #    backward simulation the student's own rollout from noise (chunk by chunk for a block-causal student), as
        #    it serves; without, a teacher sample noised to σ_k
        noise = torch.randn((len(prompts), *self.stage.latent_shape(self.video)), generator=self.generator)
        exit_step = int(torch.randint(self.sampler.num_steps, (1,), generator=self.shared_generator))
        if self.exit_steps == "last":  # (drawn all the same: the stream stays that of the default)
            exit_step = self.sampler.num_steps - 1
        with torch.set_grad_enabled(update_student):
            if self.backward_simulation or exit_step == 0:
                x0 = self.stage.sample(self.sampler, noise.to(self.device), cond, uncond, name=self.student,
                                       exit_step=exit_step, rng=self.generator).latents
            else:
                x0 = self.student_x0_from(self.teacher_samples(prompts, first), noise.to(self.device), exit_step,
                                          cond)

        # 3. student, every N-th iteration: DMD gradient (fake - real) / mean|x̂0 - real| at a random σ;
        #    teacher (its sampler's CFG) and critic run without grad, the loss reaches the student only. With the
        #    GAN term the critic runs as a constant with grad to its input, and its head scores x̂0: softplus(-logit)
        #    (on pixels: the head scores x̂0 through the frozen decoder, and the critic runs without grad).
        #    With the regression term, the first step from a teacher pair's noise regresses onto its sample
        if update_student:
            sigma = self.score_sigmas(len(prompts))
            eps = torch.randn(x0.shape, generator=self.generator).to(x0)
            pull: dict[str, torch.Tensor] = {}  # with the GAN term: each term's gradient norm at x̂0, by the backward
            x_t = noised(tapped(x0, pull, "gan") if self.critic_gan else x0.detach(), eps, sigma)
            t = self.sampler.timestep_of(sigma)
            with torch.no_grad():
                with self.stage.velocity(self.teacher) as teacher:
                    v_real = self.teacher_sampler.velocity(teacher, x_t.detach(), t, cond, uncond,
                                                           guidance_scale=self.real_guidance(sigma),
                                                           guidance_rescale=self.real_guidance_rescale)
            critic_model = self.card.models[self.critic]
            frozen_critic = frozen(critic_model) if self.critic_gan else contextlib.nullcontext()
            reading = block_features(critic_model, self.gan.blocks) if self.critic_gan else contextlib.nullcontext()
            with torch.set_grad_enabled(self.critic_gan), self.stage.velocity(self.critic) as critic, frozen_critic, \
                    reading as features:
                v_fake = critic(x_t, t, cond).float()
                gan_loss = (gan_generator_loss(self.gan_head(features())) if self.critic_gan
                            else torch.zeros(len(prompts)))
            if self.gan.enabled and not self.critic_gan:  # on pixels: x̂0 decoded with grad, through the frozen head
                with frozen(self.gan_head):
                    gan_loss = gan_generator_loss(self.gan_head(self.stage.decode(tapped(x0, pull, "gan")),
                                                                pooled_text(cond["encoder_hidden_states"])))
            x_t = x_t.detach()
            per_sample, metrics = dmd_generator_loss(tapped(x0, pull, "dmd") if self.gan.enabled else x0,
                                                     x0_from_velocity(x_t, v_real, sigma),
                                                     x0_from_velocity(x_t, v_fake.detach(), sigma))
            loss = per_sample.mean() + self.gan.generator_weight * gan_loss.to(per_sample).mean()
            if self.regression.applies(self.global_step):  # onto teacher pairs (DMD's first step, or every step:
                # ODE regression), until its warm-up ends
                regression = self.regression_loss(prompts, cond, uncond, first)
                loss = loss + self.regression.weight * regression.to(per_sample).mean()
                self.log(f"train/regression_loss/{self.student}", regression.detach().mean(), on_step=True)
            self.step_experts(loss, [self.student])
            self.log(f"train/loss/{self.student}", loss.detach(), on_step=True)
            for key, value in metrics.items():
                self.log(f"train/{key}/{self.student}", value, on_step=True)
            if self.gan.enabled:
                self.log(f"train/gan_loss/{self.student}", gan_loss.detach().mean(), on_step=True)
                if "gan" in pull and "dmd" in pull:  # the GAN term's pull on x̂0 against DMD's (weights included)
                    self.log(f"train/gan_to_dmd_grad/{self.student}", pull["gan"] / pull["dmd"], on_step=True)

        # 4. critic, every iteration: flow matching on the student's detached samples, target ε - sg(x̂0); with the
        #    GAN term, its head learns teacher samples (real) from the student's (fake), both noised at a fresh σ
        sample = x0.detach()
        sigma = self.score_sigmas(len(prompts))
        eps = torch.randn(sample.shape, generator=self.generator).to(sample)
        with self.stage.velocity(self.critic) as critic:
            v = critic(noised(sample, eps, sigma), self.sampler.timestep_of(sigma), cond)
        critic_loss = flow_matching_loss(v, sample, eps)[0].mean()
        losses = [lambda: critic_loss]
        if self.gan.enabled:
            real = self.teacher_samples(prompts, first) if data_reals is None else data_reals
            # the head's noise, drawn on pixels too though unread there (the stream the measured figures used)
            sigma = self.score_sigmas(2 * len(prompts))
            eps = torch.randn((2 * len(prompts), *sample.shape[1:]), generator=self.generator).to(sample)
            # its own forward: the flow-matching graph never reaches the head
            losses.append(lambda: self.gan_head_loss(real, sample, cond, sigma, eps))
        self.step_experts(losses, [self.critic])

        # 5. log
        self.log(f"train/loss/{self.critic}", critic_loss.detach(), prog_bar=True, on_step=True)
        self.log("train/exit_step", float(exit_step), on_step=True)
        return critic_loss.detach()

    @torch.no_grad()
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """Latent MSE of the served student to the teacher's many-step CFG sample from the same noise (seed =
        batch index): a cheap proxy of "closer to the teacher", comparable across the run."""
        prompts, first = list(batch["prompt"]), self.first_frames(batch)
        student = self.generate(prompts, seed=batch_idx, latents_only=True, **first)
        noise = torch.randn(student.shape, generator=torch.Generator().manual_seed(batch_idx)).to(self.device)
        cond, uncond = self.conditioning(prompts, self.teacher_sampler, **first)
        teacher = self.stage.sample(self.teacher_sampler, noise, cond, uncond, name=self.teacher).latents
        self.log("val/latent_mse_to_teacher", (student - teacher).pow(2).mean(), prog_bar=True,
                 batch_size=len(prompts), sync_dist=True)

    # ------------------------------------------------------------------ helpers
    def _problems(self, backward_simulation, exit_steps, generator_update_ratio, sigma_range, ema_decay,
                  real_guidance_scale, real_guidance_rescale, real_guidance_interval) -> list[str]:
        """Every configuration problem but the student's steps, collected before anything is built."""
        problems = self.card_problems("dmd2", trains=(self.student,))
        problems += self.stage.peer_problems(self.critic, "the fake score", trainable=True,
                                             hint="; add a trainable `critic` expert, e.g. `init_from: teacher`")
        problems += self.stage.peer_problems(self.teacher, "the real score", trainable=False,
                                             hint="; add the frozen many-step `teacher` expert (`pretrained:` its "
                                                  "weights)")
        if self.card.has(f"{self.teacher}_2"):  # a pair of noise experts as the teacher (Wan 2.2 A14B)
            problems += self.stage.peer_problems(f"{self.teacher}_2", "the real score's low-noise expert",
                                                 trainable=False)
        if generator_update_ratio < 1:
            problems.append(f"generator_update_ratio={generator_update_ratio} must be >= 1 (the student steps on "
                            f"every N-th iteration; anchor 5)")
        low, high = sigma_range
        if not 0.0 < low < high <= 1.0:
            problems.append(f"sigma_range={tuple(sigma_range)} must satisfy 0 < low < high <= 1 (anchor (0.02, 0.98))")
        if not backward_simulation and self.sampler.chunk_frames is not None:
            problems.append(f"backward_simulation=False feeds the student's exit step a noised teacher sample, but "
                            f"sampler.chunk_frames={self.sampler.chunk_frames} rolls it out chunk by chunk through its "
                            f"own KV cache (Self-Forcing): keep backward_simulation: true")
        problems += self.gan.problems() + self.regression.problems()
        exits = {"random": "DMD2's, a step drawn each iteration", "last": "the served sample alone"}
        if exit_steps not in exits:
            problems.append(f"exit_steps={exit_steps!r} must be " +
                            " or ".join(f"'{k}' ({m})" for k, m in exits.items()))
        if ema_decay is not None and not 0.0 < ema_decay < 1.0:
            problems.append(f"ema_decay={ema_decay} must be in (0, 1) (e.g. 0.99; null serves the student itself)")
        if real_guidance_scale is not None and real_guidance_scale < 1.0:
            problems.append(f"real_guidance_scale={real_guidance_scale} must be >= 1 (1 = the teacher's score "
                            f"unguided; null = the teacher sampler's CFG, {TEACHER_CFG} by default)")
        if real_guidance_rescale is not None and not 0.0 <= real_guidance_rescale <= 1.0:
            problems.append(f"real_guidance_rescale={real_guidance_rescale} must be in [0, 1] (CFG rescale's φ: 0 = "
                            f"plain CFG, Lin et al. use 0.7; null = the teacher sampler's)")
        if real_guidance_interval is not None and not 0.0 <= real_guidance_interval[0] < real_guidance_interval[1]:
            problems.append(f"real_guidance_interval={tuple(real_guidance_interval)} must be (low, high) with 0 <= "
                            f"low < high: the σ where the real score is guided (e.g. [0.22, 0.84]; null = every σ)")
        return problems

    def regression_loss(self, prompts: list[str], cond, uncond, first: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B,) latent MSE of the student's x̂0 to a teacher pair's sample, one pair drawn per prompt: from the
        pair's noise through the student's first step (``regression.steps: first``, as it serves: a block-causal
        student's chunk by chunk through its KV cache), or from a random step on the pair's sample noised by its
        noise (``every``: ODE regression). With the caller's grad."""
        pairs = torch.randint(self.regression.pairs, (len(prompts),), generator=self.generator).tolist()
        noise, target = self.teacher_pairs(prompts, pairs, first)
        if self.regression.steps == "first":
            x0_hat = self.stage.sample(self.sampler, noise, cond, uncond, name=self.student, exit_step=0,
                                       rng=self.generator).latents
        else:
            step = int(torch.randint(self.sampler.num_steps, (1,), generator=self.shared_generator))
            x0_hat = self.student_x0_from(target, noise, step, cond)
        regression = (x0_hat.float() - target).pow(2)
        return regression.mean(dim=tuple(range(1, regression.ndim)))

    def gan_head_loss(self, real: torch.Tensor, fake: torch.Tensor, cond, sigma: torch.Tensor,
                      eps: torch.Tensor) -> torch.Tensor:
        """The head's real-vs-fake loss in the critic's update, weighted (``gan.critic_weight``): on the critic's
        block features of both noised at ``sigma`` by ``eps``, or on pixels both decoded alike, not noised."""
        if not self.critic_gan:
            with torch.no_grad():
                clips = self.stage.decode(torch.cat([real, fake]))
            text = pooled_text(cond["encoder_hidden_states"])
            real_logits, fake_logits = self.gan_head(clips, torch.cat([text, text])).chunk(2)
        else:
            with self.stage.velocity(self.critic) as critic, \
                    block_features(self.card.models[self.critic], self.gan.blocks) as features:
                critic(noised(torch.cat([real, fake]), eps, sigma), self.sampler.timestep_of(sigma),
                       Conditioning.cat([cond, cond]))
            real_logits, fake_logits = self.gan_head(features()).chunk(2)
        per_sample, metrics = gan_critic_loss(real_logits, fake_logits)
        self.log(f"train/gan_loss/{self.critic}", per_sample.detach().mean(), on_step=True)
        for key, value in metrics.items():
            self.log(f"train/{key}/{self.critic}", value, on_step=True)
        return self.gan.critic_weight * per_sample.mean()

    def real_guidance(self, sigma: torch.Tensor) -> Optional[float | torch.Tensor]:
        """The real score's CFG scale: the option's (None: the teacher sampler's), or, with an interval, per sample:
        that scale where σ lies in the interval and 1 (unguided) elsewhere."""
        if self.real_guidance_interval is None:
            return self.real_guidance_scale
        scale = self.real_guidance_scale or self.teacher_sampler.guidance_scale
        low, high = self.real_guidance_interval
        inside = (sigma >= low) & (sigma <= high)
        return torch.where(inside, torch.full_like(sigma, scale), torch.ones_like(sigma))

    def score_sigmas(self, batch_size: int) -> torch.Tensor:
        """(B,) σ ~ U[sigma_range], flow-shifted: where the scores are compared and the critic trains."""
        low, high = self.sigma_range
        return sample_sigmas(batch_size, "uniform", self.generator, self.shift, low=low, high=high).to(self.device)

    @property
    def gan_head(self) -> torch.nn.Module:
        return getattr(self.card.models[self.critic], HEAD)

    def student_x0_from(self, clean: torch.Tensor, noise: torch.Tensor, step: int, cond) -> torch.Tensor:
        """x̂0 of the student's step ``step`` run on ``clean`` noised to that step's σ (with the caller's grad)."""
        schedule = self.stage.schedule(self.sampler, tuple(noise.shape[1:]), noise.device)
        sigma = schedule.sigmas[step].expand(len(noise))
        x = noised(clean, noise, sigma)
        chunk = self.sampler.chunk_frames  # a block-causal student: the whole clip under its chunks' mask
        with self.stage.velocity(self.student) as student:
            run = student if chunk is None else lambda x, t, c: student(x, t, c, num_frames_per_chunk=chunk)
            v = self.sampler.velocity(run, x, schedule.timesteps[step], cond)
        return x0_from_velocity(x, v, sigma)

    def teacher_samples(self, prompts: list[str], first: Optional[dict[str, torch.Tensor]] = None) -> torch.Tensor:
        """(B, C, F, h, w) one teacher sample per prompt (and first frame: ``first_frames``; its pair 0,
        ``teacher_pairs``): the GAN's real samples and, without backward simulation, the student's inputs."""
        return self.teacher_pairs(prompts, [0] * len(prompts), first)[1]

    @torch.no_grad()
    def data_reals(self, batch: dict) -> torch.Tensor:
        """(B, C, F, h, w) the batch's clean latents (``gan.reals: data``): its precomputed ones, or the VAE's of its
        videos, which must have the run's size."""
        real = self.batch_latents(batch, "gan.reals: data reads the batch's clips as the GAN head's real samples",
                                  " or set gan.reals: teacher")
        expected = (real.shape[0], *self.stage.latent_shape(self.video))
        if tuple(real.shape) != expected:
            raise ValueError(f"gan.reals: data: the batch's clips encode to latents {tuple(real.shape)}, the student's "
                             f"samples are {expected}: give the data the run's frames, height and width "
                             f"(model.init_args.run)")
        return real

    @torch.no_grad()
    def teacher_pairs(self, prompts: list[str], pairs: list[int], first: Optional[dict[str, torch.Tensor]] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(noise, sample), each (B, C, F, h, w): pair ``pairs[i]`` of prompt ``prompts[i]`` (and, image-to-video, of
        its first frame: row i of ``first``, ``first_frames``), the teacher's sample (its sampler: many steps, CFG)
        from that noise. Drawn once, one at a time, from noise seeded by the prompt's text, the first frame's bytes,
        the pair's index and ``run.seed`` (its own stream: the run's noise is not drawn from), so the same pair is
        always the same and a resumed run recomputes exactly what it had. DMD's regression loss maps noise to sample
        (the teacher's ODE); pair 0 is also the GAN's real sample of the prompt."""
        first = first or {}
        rows = [{key: value[i:i + 1] for key, value in first.items()} for i in range(len(prompts))]
        keys = [(prompt, j, frame_digest(row)) for prompt, j, row in zip(prompts, pairs, rows)]
        for (prompt, j, image), row in dict(zip(keys, rows)).items():
            if (prompt, j, image) not in self._teacher_bank:
                text = (prompt if j == 0 else f"{prompt}\x00{j}") + (f"\x01{image}" if image else "")
                digest = int(hashlib.sha256(text.encode()).hexdigest()[:12], 16)
                rng = torch.Generator().manual_seed(self.run.seed * 1_000_003 + digest)
                noise = torch.randn((1, *self.stage.latent_shape(self.video)), generator=rng).to(self.device)
                cond, uncond = self.conditioning([prompt], self.teacher_sampler, **row)
                sample = self.stage.sample(self.teacher_sampler, noise, cond, uncond, name=self.teacher, rng=rng)
                self._teacher_bank[prompt, j, image] = (noise[0], sample.latents[0])
        chosen = [self._teacher_bank[key] for key in keys]
        return torch.stack([n for n, _ in chosen]), torch.stack([x for _, x in chosen])


def frame_digest(first: dict[str, torch.Tensor]) -> str:
    """A short digest of one row's first frame as ``first_frames`` gives it (the image, or the cached clip latents
    it is read off): its bytes, which key the teacher's pairs of an image-to-video generator; "" for a generator
    that reads no image."""
    digest = hashlib.sha256()
    for key, value in sorted(first.items()):
        digest.update(key.encode() + value.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16] if first else ""


def student_steps_problems(sampler: FlowMatchSampler, steps: int) -> list[str]:
    """Problems of ``student_steps`` with the given sampler (a sampler that lists its steps must list that many)."""
    if steps < 1:
        return [f"student_steps={steps} must be >= 1 (the student's sampling steps, e.g. 1, 2 or 4)"]
    if sampler.step_sigmas is not None and len(sampler.step_sigmas) != steps:
        return [f"student_steps={steps} but sampler.step_sigmas={sampler.step_sigmas} lists "
                f"{len(sampler.step_sigmas)} steps: drop sampler.step_sigmas (the steps follow student_steps) or "
                f"make them agree"]
    return []


def student_sampler(sampler: FlowMatchSampler, steps: int) -> FlowMatchSampler:
    """``sampler`` with the student's ``steps``-step list σ = 1, (n-1)/n, …, 1/n (before the flow shift)."""
    return FlowMatchSampler(num_steps=steps, scheduler=sampler.scheduler, guidance_scale=sampler.guidance_scale,
                            noise_level=sampler.noise_level, sde_window=sampler.sde_window,
                            step_sigmas=[1.0 - i / steps for i in range(steps)], chunk_frames=sampler.chunk_frames,
                            cache_chunks=sampler.cache_chunks, sink_chunks=sampler.sink_chunks,
                            guidance_rescale=sampler.guidance_rescale)
