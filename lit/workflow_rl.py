"""Workflow RL: one reward on the final video trains every stage of a cross-model workflow.

METHODS.md (workflow_rl). Stages in order — optionally refiner LMs, then a text-to-image generator
(FLUX), then an image-to-video generator (Wan I2V) — each with its own sampler, experts, optimizer and
version (``modules/workflow.py``). Per prompt, K samples flow through the whole chain: every trainable
stage rolls out with the SDE step of its own sampler and captures its per-step log p (refiners: token
log p); a frozen stage (``trainable: false``) runs its ODE. The I2V stage's conditioning image is the T2I
stage's sampled image, fixed context for the I2V policy: no gradient flows from one stage into another,
each stage learns only through the reward. One reward scores the final video (its terms may read
intermediate media, ``StageReward``); advantages are grouped per prompt; ``credit: shared`` gives every
stage the advantage of the total, ``per_stage`` gives stage s the advantage of its own term
(``Stage.credit``, e.g. ``colour`` for the image stage, ``motion`` for the video stage). Each trainable
stage then takes its own Flow-GRPO PPO-clip loss with a KL to its own frozen reference (refiners: the
token policy gradient with a k3 KL), and its own optimizer step. The C2 identity is checked for every
stage that captured log-probs. One iteration = one prompt batch through the chain and every update.

    posttrain fit --config configs/workflow_rl.yaml
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from posttrain.callbacks.parity import report_rollout
from posttrain.lit.base import RunArgs
from posttrain.lit.workflow import Workflow
from posttrain.modules.advantages import group_advantages
from posttrain.modules.cards import ModelCard
from posttrain.modules.conditioning import Conditioning
from posttrain.modules.refiners import Refinements, completion_log_probs, compose_prompt, k3_kl, sample_refinements, \
    token_pg_loss
from posttrain.modules.rewards import ColourAlignment, Reward, RewardOutput, score, term_of
from posttrain.modules.rollout import c2_gap, mean_metrics, ppo_step_losses, rollout, train_steps
from posttrain.modules.samplers import Trajectory
from posttrain.modules.workflow import Stage


@dataclass
class GeneratorRollout:
    """One generator stage's rollout: what it was conditioned on and its trajectory (B·K rows)."""

    cond: Conditioning
    uncond: Optional[Conditioning]
    traj: Trajectory


class WorkflowRL(Workflow):
    """Args:
        card: the experts of every stage, namespaced by stage (``t2i_transformer``, ``i2v_transformer``, …);
            a trainable stage's experts are ``trainable: true`` with an optimizer, a frozen one's are not.
        stages: the stages in order (``modules.workflow.Stage``: sampler, size, ``trainable``, ``credit``).
        reward: scores the final media against the original prompts (context: ``stages`` media,
            ``refinements``); None = ``ColourAlignment()``.
        num_samples_per_prompt: K, the group size (>= 2).
        credit: ``shared``: every stage is credited with the total's advantage; ``per_stage``: stage s with
            the advantage of its reward term ``stages[s].credit``.
        timestep_fraction: share of a generator's SDE steps trained on per iteration.
        clip_range: the generators' PPO ε.
        kl_beta: weight of each generator's KL to its own frozen reference; 0 adds no reference.
        refiner_kl: weight of each refiner's k3 KL to its frozen reference.
        advantage_std: normalize advantages by the group's std or the whole batch's.
        adv_clip: advantages are clipped to ±adv_clip.
        run: the seed and NaN tolerance.
    """

    def __init__(self, card: ModelCard, stages: list[Stage], reward: Optional[Reward] = None,
                 num_samples_per_prompt: int = 4, credit: Literal["shared", "per_stage"] = "shared",
                 timestep_fraction: float = 0.5, clip_range: float = 1e-3, kl_beta: float = 0.004,
                 refiner_kl: float = 0.01, advantage_std: Literal["group", "global"] = "group",
                 adv_clip: float = 5.0, run: Optional[RunArgs] = None):
        super().__init__(card, stages, run)
        self.reward = reward if reward is not None else ColourAlignment()
        problems = self._problems(num_samples_per_prompt, credit, timestep_fraction, clip_range, kl_beta, refiner_kl)
        if problems:
            raise ValueError("workflow_rl:\n  - " + "\n  - ".join(problems))
        self.num_samples_per_prompt, self.credit = num_samples_per_prompt, credit
        self.timestep_fraction, self.clip_range, self.kl_beta = timestep_fraction, clip_range, kl_beta
        self.refiner_kl = refiner_kl
        self.advantage_std, self.adv_clip = advantage_std, adv_clip

    def setup_roles(self) -> None:
        for stage in self.stages:
            if not stage.trainable:
                continue
            for name in self.plan.experts_of(stage):
                if stage.kind == "refiners" or self.kl_beta > 0:
                    self.card.add_role("reference", of=name)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        prompts = list(batch["prompt"])
        if not prompts:
            raise ValueError("workflow_rl: the batch holds no prompts")
        K = self.num_samples_per_prompt
        originals = [p for p in prompts for _ in range(K)]  # sample j = b·K + k of prompt b
        group_ids = torch.as_tensor(batch["seed"]).repeat_interleave(K)
        timings: dict[str, float] = {}

        # 1. roll out the chain, K samples per prompt, each stage on the previous one's output:
        #    refiners sample text (token log p), trainable generators their SDE (step log p), frozen ones their ODE
        text, media = originals, None
        refined: dict[str, Refinements] = {}
        rollouts: dict[str, GeneratorRollout] = {}
        stage_media: dict[str, torch.Tensor] = {}
        for stage in self.stages:
            start = time.perf_counter()
            if stage.kind == "refiners":
                for name in self.plan.refiners_of(stage):
                    refined[name] = sample_refinements(self.card[name], self.card.tokenizers[name], text, self.generator,
                                                       stage.max_new_tokens, stage.temperature, stage.template)
                text = [compose_prompt(p, [refined[n].texts[j] for n in self.plan.refiners_of(stage)])
                        for j, p in enumerate(text)]
            else:
                gen = self.plan.generators[stage.name]
                images = media[:, :, 0] if gen.takes_image else None  # the previous stage's samples: fixed context
                cond, uncond = gen.conditioning(text, stage.sampler.guidance_scale, self.device, images=images,
                                                size=stage.size)
                traj = rollout(gen, stage.sampler, cond, gen.latent_shape(stage.size), self.generator,
                               sde=stage.trainable, uncond=uncond)
                media = gen.decode(traj.latents)  # (B·K, 3, F, H, W) in [-1, 1]
                rollouts[stage.name] = GeneratorRollout(cond, uncond, traj)
                stage_media[stage.name] = media
            timings[f"{stage.name}/rollout"] = time.perf_counter() - start

        # 2. one reward on the final media; its terms may read every stage's media and the refinements
        start = time.perf_counter()
        context = {"original_prompts": originals, "stages": stage_media,
                   "refinements": {name: sample.texts for name, sample in refined.items()}}
        rewards = score(self.reward, media, text, context)
        timings["score"] = time.perf_counter() - start

        # 3. group advantages: of the total, or (credit: per_stage) of each stage's own term
        total_advantages = group_advantages(rewards.total, group_ids, self.advantage_std, self.adv_clip).to(self.device)
        advantages = {stage.name: total_advantages if self.credit == "shared" or stage.credit is None else
                      group_advantages(self._term(rewards, stage.credit), group_ids, self.advantage_std,
                                       self.adv_clip).to(self.device)
                      for stage in self.stages if stage.trainable}

        # 4. C2: before any update, every captured log p is recomputed at the rollout's weights
        report_rollout(self, lambda: self._c2_gap(refined, rollouts))

        # 5. update each trainable stage from its own rollout, with its own optimizer (its version moves)
        for stage in self.stages:
            if not stage.trainable:
                continue
            start = time.perf_counter()
            if stage.kind == "refiners":
                self._update_refiners(stage, refined, advantages[stage.name])
            else:
                self._update_generator(stage, rollouts[stage.name], advantages[stage.name])
            timings[f"{stage.name}/update"] = time.perf_counter() - start

        # 6. log: rewards and their terms, each stage's credited reward, timings
        self.log("train/reward", rewards.total.mean(), prog_bar=True, on_step=True)
        for name, value in rewards.terms.items():
            self.log(f"train/reward/{name}", value.mean(), on_step=True)
        for name, seconds in timings.items():
            self.log(f"train/time/{name}", seconds, on_step=True)
        self.log("train/cache_hit_rate", self.card.cache.hit_rate, on_step=True)
        return rewards.total.mean().detach()

    def _update_generator(self, stage: Stage, out: GeneratorRollout, advantages: torch.Tensor) -> None:
        """Flow-GRPO on the stage's own rollout: PPO-clip on a fraction of its SDE steps + KL to its reference,
        on the samples with signal; each step's loss is backed up before the next one runs."""
        gen = self.plan.generators[stage.name]
        keep = torch.nonzero(advantages != 0).flatten()
        if not self.any_rank(len(keep) > 0):
            return  # no signal anywhere: no step, no version bump
        keep = keep if len(keep) else torch.arange(len(advantages), device=self.device)
        steps = train_steps(stage.sampler, self.timestep_fraction, self.generator)
        reference = f"{gen.transformer}_reference" if self.kl_beta > 0 else None
        metrics: dict[str, list[torch.Tensor]] = {}
        self.step_experts(ppo_step_losses(gen, stage.sampler, out.traj, steps, out.cond, advantages, self.clip_range,
                                          self.kl_beta, out.uncond, index=keep, reference=reference, metrics=metrics),
                          [gen.transformer])
        metrics = mean_metrics(metrics)
        self.log(f"train/loss/{gen.transformer}", metrics["loss"], on_step=True)
        self.log(f"train/ppo_ratio_mean/{gen.transformer}", metrics["ratio_mean"], on_step=True)
        self.log(f"train/kl/{gen.transformer}", metrics["kl"], on_step=True)

    def _update_refiners(self, stage: Stage, refined: dict[str, Refinements], advantages: torch.Tensor) -> None:
        """Token policy gradient + k3 KL to each refiner's reference; one backward over the stage's refiners."""
        if not self.any_rank(bool((advantages != 0).any())):
            return
        losses = []
        for name in self.plan.refiners_of(stage):
            sample = refined[name]
            log_probs = completion_log_probs(self.card[name], sample, stage.temperature)  # (B·K, T), grad
            with torch.no_grad(), self.card.use(f"{name}_reference") as reference:
                ref_log_probs = completion_log_probs(reference, sample, stage.temperature)
            pg, _ = token_pg_loss(log_probs, advantages, sample.mask)
            kl, _ = k3_kl(log_probs, ref_log_probs, sample.mask)
            losses.append(pg.mean() + self.refiner_kl * kl.mean())
            self.log(f"train/loss/{name}", losses[-1].detach(), on_step=True)
        self.step_experts(torch.stack(losses).sum(), self.plan.refiners_of(stage))

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """Reward of the served chain (ODE, each stage's sampler) from fixed seeds: comparable across the run."""
        prompts = list(batch["prompt"])
        outputs = self.run_stages(prompts, seed=batch_idx)
        final = outputs[self.stages[-1].name]
        context = {"original_prompts": prompts, "stages": {n: o.media for n, o in outputs.items() if o.media is not None},
                   "refinements": {n: t for o in outputs.values() for n, t in o.refinements.items()}}
        rewards = score(self.reward, final.media, final.prompts, context)
        self.log("val/reward", rewards.total.mean(), prog_bar=True, batch_size=len(prompts))
        for name, value in rewards.terms.items():
            self.log(f"val/reward/{name}", value.mean(), batch_size=len(prompts))

    # ------------------------------------------------------------------ helpers
    def _c2_gap(self, refined: dict[str, Refinements], rollouts: dict[str, GeneratorRollout]) -> torch.Tensor:
        """max |recomputed − captured log p| over every trainable stage: SDE steps and refiner tokens."""
        gaps = [torch.zeros(())]
        for stage in self.stages:
            if not stage.trainable:
                continue
            if stage.kind == "generator":
                out = rollouts[stage.name]
                gaps.append(c2_gap(self.plan.generators[stage.name], stage.sampler, out.traj, out.cond,
                                   out.uncond).cpu())
                continue
            with torch.no_grad():
                for name in self.plan.refiners_of(stage):
                    recomputed = completion_log_probs(self.card[name], refined[name], stage.temperature)
                    gaps.append((recomputed - refined[name].log_probs).abs().max().cpu())
        return torch.stack(gaps).max()

    def _term(self, rewards: RewardOutput, name: str) -> torch.Tensor:
        try:
            return term_of(rewards, name)
        except KeyError as err:
            raise ValueError(f"workflow_rl credit by reward term: {err.args[0]}") from err

    def _problems(self, K: int, credit: str, timestep_fraction: float, clip_range: float, kl_beta: float,
                  refiner_kl: float) -> list[str]:
        problems = []
        trainable = [s for s in self.stages if s.trainable]
        if not trainable:
            problems.append("every stage has trainable: false; set it true on the stages to train")
        for i, stage in enumerate(self.stages):
            where = f"stages[{i}] ({stage.name})"
            for name in self.plan.experts_of(stage):
                if name not in self.card.specs:
                    continue  # reported by the plan
                if stage.trainable and not self.card.specs[name].trainable:
                    problems.append(f"{where} is trainable but expert {name!r} is not: set its `trainable: true` "
                                    f"and give it an optimizer, or set the stage's trainable: false")
                if not stage.trainable and self.card.specs[name].trainable:
                    problems.append(f"{where} has trainable: false but expert {name!r} is trainable: set its "
                                    f"`trainable: false` and remove its optimizer")
            if stage.kind == "generator" and stage.trainable:
                if not stage.sampler.euler:
                    problems.append(f"{where}: SDE rollouts need the Euler flow scheduler "
                                    f"(diffusers.FlowMatchEulerDiscreteScheduler), got "
                                    f"{type(stage.sampler.scheduler).__name__}")
                elif not bool(stage.sampler.sde_steps().any()):
                    problems.append(f"{where}: the sampler's sde_window holds no step")
            if credit == "per_stage" and stage.trainable and stage.credit is None:
                problems.append(f"{where}: credit=per_stage needs the stage's `credit:` reward term (e.g. colour), "
                                f"or use credit: shared")
        if credit not in ("shared", "per_stage"):
            problems.append(f"credit={credit!r}; choose 'shared' or 'per_stage'")
        if K < 2:
            problems.append(f"num_samples_per_prompt={K} must be >= 2: group advantages compare K samples of a prompt "
                            f"(Flow-GRPO uses 8 to 24)")
        if not 0.0 < timestep_fraction <= 1.0:
            problems.append(f"timestep_fraction={timestep_fraction} must be in (0, 1]")
        if clip_range <= 0:
            problems.append(f"clip_range={clip_range} must be > 0 (PPO's ε; the default is 1e-3)")
        if kl_beta < 0 or refiner_kl < 0:
            problems.append(f"kl_beta={kl_beta} and refiner_kl={refiner_kl} must be >= 0")
        if credit == "per_stage" and not problems:
            problems += self._missing_terms([s for s in trainable if s.credit is not None])
        return problems

    def _missing_terms(self, stages: list[Stage]) -> list[str]:
        """Per-stage credit reads reward terms: ask the reward once, on a dry run of the chain's media shapes."""
        stage_media = {s.name: torch.zeros(1, 3, s.frames, s.height, s.width) for s in self.stages
                       if s.kind == "generator"}
        context = {"original_prompts": ["a red circle moving left on a blue background"], "stages": stage_media,
                   "refinements": {n: [""] for s in self.stages if s.kind == "refiners"
                                   for n in self.plan.refiners_of(s)}}
        try:
            out = score(self.reward, stage_media[self.stages[-1].name], context["original_prompts"], context)
        except Exception as err:  # noqa: BLE001 - reported as a config problem, with the reward's own message
            return [f"credit=per_stage: the reward failed on a dry run ({type(err).__name__}: {err})"]
        problems = []
        for stage in stages:
            try:
                term_of(out, stage.credit)
            except KeyError:
                problems.append(f"stage {stage.name!r}: credit {stage.credit!r} is not a reward term; the reward's "
                                f"terms are {sorted(out.terms)}")
        return problems
