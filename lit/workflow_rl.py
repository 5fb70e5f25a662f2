"""Workflow RL: one reward on the final video trains every stage of a cross-model workflow.

docs/methods.md#workflow-rl. Stages in order — optionally refiner LMs, then a text-to-image generator
(FLUX), then an image-to-video generator (Wan I2V) — each with its own sampler, experts, optimizer and
version (``modules/rl/workflow.py``). Per prompt, K samples flow through the whole chain: every trainable
stage rolls out with the SDE step of its own sampler and captures its per-step log p (refiners: token
log p); a frozen stage (``trainable: false``) runs its ODE. The I2V stage's conditioning image is the T2I
stage's sampled image, fixed context for the I2V policy: no gradient flows from one stage into another,
each stage learns only through the reward. One reward scores the final video (its terms may read
intermediate media, ``StageReward``); advantages are grouped per prompt; ``credit: shared`` gives every
stage the advantage of the total, ``per_stage`` gives stage s the advantage of its own term
(``Stage.credit``, e.g. ``colour`` for the image stage, ``motion`` for the video stage). Each trainable
stage then takes its own Flow-GRPO PPO-clip loss with a KL to its own frozen reference (refiners: the
token policy gradient with a k3 KL), and its own optimizer step. Log-probability parity (recomputed ==
captured at the rollout's weights) is checked for every stage that captured log-probs. One iteration = one
prompt batch through the chain and every update.

    posttrain fit --config configs/workflow_rl.yaml
"""
from __future__ import annotations

import time
from typing import Literal, Optional

import torch

from posttrain.callbacks.parity import report_rollout
from posttrain.lit.base import RunArgs
from posttrain.lit.workflow import Workflow
from posttrain.modules.io import batch as batch_schema
from posttrain.modules.models.cards import ModelCard
from posttrain.modules.rl.grpo import GRPOArgs, sde_problems, train_rows
from posttrain.modules.models.refiners import Refinements, compose_prompt, refiner_logprob_gap, refiner_loss, sample_refinements
from posttrain.modules.rewards.synthetic import ColourAlignment
from posttrain.modules.rewards.base import Reward, credited_term, score, term_problems
from posttrain.modules.rl.rollout import Rollout, mean_metrics, train_steps
from posttrain.modules.rl.workflow import Stage


class WorkflowRL(Workflow):
    """Args:
        card: the experts of every stage, namespaced by stage (``t2i_transformer``, ``i2v_transformer``, …);
            a trainable stage's experts are ``trainable: true`` with an optimizer, a frozen one's are not.
        stages: the stages in order (``modules.workflow.Stage``: samplers, size, ``trainable``, ``credit``); a
            generator stage rolls out with its ``rollout_sampler``.
        reward: scores the final media against the original prompts (context: ``stages`` media,
            ``refinements``); None = ``ColourAlignment()``.
        grpo: the GRPO settings of every generator stage (K, timestep fraction, PPO clip, each stage's KL to its
            own reference, advantages, which rows train, micro-batches; ``modules.grpo.GRPOArgs``); one update
            per rollout batch (no inner epochs or minibatches).
        credit: ``shared``: every stage is credited with the total's advantage; ``per_stage``: stage s with
            the advantage of its reward term ``stages[s].credit``.
        refiner_kl: weight of each refiner's k3 KL to its frozen reference.
        run: the seed and NaN tolerance.
    """

    def __init__(self, card: ModelCard, stages: list[Stage], reward: Optional[Reward] = None,
                 grpo: Optional[GRPOArgs] = None, credit: Literal["shared", "per_stage"] = "shared",
                 refiner_kl: float = 0.01, run: Optional[RunArgs] = None):
        super().__init__(card, stages, run)
        self.reward = reward if reward is not None else ColourAlignment()
        self.grpo = grpo or GRPOArgs()
        problems = self._problems(credit, refiner_kl)
        if problems:
            raise ValueError("workflow_rl:\n  - " + "\n  - ".join(problems))
        self.credit, self.refiner_kl = credit, refiner_kl
        self.references: dict[str, str] = {}  # expert -> its frozen reference, added with the card's roles

    def setup_roles(self) -> None:
        for stage in self.stages:
            if not stage.trainable:
                continue
            for name in self.plan.experts_of(stage):
                if stage.kind == "refiners" or self.grpo.kl_beta > 0:
                    self.references[name] = self.card.add_role("reference", of=name)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        prompts = batch_schema.prompts(batch, "workflow_rl")
        K = self.grpo.num_samples_per_prompt
        originals = [p for p in prompts for _ in range(K)]  # sample j = b·K + k of prompt b
        group_ids = batch_schema.group_ids(batch, K)
        timings: dict[str, float] = {}

        # 1. roll out the chain, K samples per prompt, each stage on the previous one's output:
        #    refiners sample text (token log p), trainable generators their SDE (step log p), frozen ones their ODE
        text, media = originals, None
        refined: dict[str, Refinements] = {}
        rollouts: dict[str, Rollout] = {}
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
                generator = self.plan.generators[stage.name]
                images = media[:, :, 0] if generator.takes_image else None  # the previous stage's samples: fixed context
                cond, uncond = generator.conditioning(text, stage.rollout_sampler.guidance_scale, self.device,
                                                      images=images, size=stage.size)
                rollouts[stage.name] = Rollout.sample(generator, stage.rollout_sampler, cond, uncond,
                                                      generator.latent_shape(stage.size), self.generator,
                                                      sde=stage.trainable)
                media = generator.decode(rollouts[stage.name].latents)  # (B·K, 3, F, H, W) in [-1, 1]
                stage_media[stage.name] = media
            timings[f"{stage.name}/rollout"] = time.perf_counter() - start

        # 2. one reward on the final media; its terms may read every stage's media and the refinements
        start = time.perf_counter()
        context = {"original_prompts": originals, "stages": stage_media,
                   "refinements": {name: sample.texts for name, sample in refined.items()}}
        rewards = score(self.reward, media, text, context)
        timings["score"] = time.perf_counter() - start

        # 3. group advantages: of the total, or (credit: per_stage) of each stage's own term
        total_advantages = self.grpo.advantages(rewards.total, group_ids).to(self.device)
        advantages = {stage.name: total_advantages if self.credit == "shared" or stage.credit is None else
                      self.grpo.advantages(credited_term(rewards, stage.credit, "workflow_rl"), group_ids).to(self.device)
                      for stage in self.stages if stage.trainable}

        # 4. log-probability parity: before any update, every captured log p is recomputed at the rollout's weights
        report_rollout(self, lambda: self._logprob_gap(refined, rollouts))

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

    def _update_generator(self, stage: Stage, rollout: Rollout, advantages: torch.Tensor) -> None:
        """Flow-GRPO on the stage's own rollout: PPO-clip on a fraction of its SDE steps + KL to its reference,
        on the rows with signal (modules/rl/grpo.py's rule); each step's loss is backed up before the next one runs."""
        grpo, policy = self.grpo, rollout.stage.transformer
        keep = train_rows(advantages, self.any_rank, self.trainer.world_size > 1, grpo.drop_zero_advantage)
        self.log(f"train/kept_samples/{policy}", float(len(keep)), on_step=True)
        if not len(keep):
            return  # no signal anywhere: no step, no version bump
        steps = train_steps(stage.rollout_sampler, grpo.timestep_fraction, self.generator)
        metrics: dict[str, list[torch.Tensor]] = {}
        self.step_experts(rollout.select(keep).step_losses(steps, advantages[keep], grpo.clip_range, grpo.kl_beta,
                                                           self.references.get(policy), grpo.micro_batch_size,
                                                           metrics), [policy])
        for key, value in mean_metrics(metrics).items():
            self.log(f"train/{key}/{policy}", value, on_step=True)

    def _update_refiners(self, stage: Stage, refined: dict[str, Refinements], advantages: torch.Tensor) -> None:
        """Token policy gradient + k3 KL to each refiner's reference; one backward over the stage's refiners,
        when any process has a row with signal."""
        if not self.any_rank(bool((advantages != 0).any())):
            return
        losses = []
        for name in self.plan.refiners_of(stage):
            loss, metrics = refiner_loss(self.card, name, self.references[name], refined[name], advantages,
                                         stage.temperature, self.refiner_kl)
            losses.append(loss)
            self.log(f"train/loss/{name}", loss.detach(), on_step=True)
            self.log(f"train/kl/{name}", metrics["kl"], on_step=True)
        self.step_experts(torch.stack(losses).sum(), self.plan.refiners_of(stage))

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """Reward of the served chain (ODE, each stage's sampler) from fixed seeds: comparable across the run."""
        prompts = list(batch["prompt"])
        outputs = self.run_stages(prompts, seed=batch_idx)
        final = outputs[self.stages[-1].name]
        context = {"original_prompts": prompts, "stages": {n: o.media for n, o in outputs.items() if o.media is not None},
                   "refinements": {n: t for o in outputs.values() for n, t in o.refinements.items()}}
        rewards = score(self.reward, final.media, final.prompts, context)
        self.log("val/reward", rewards.total.mean(), prog_bar=True, batch_size=len(prompts), sync_dist=True)
        for name, value in rewards.terms.items():
            self.log(f"val/reward/{name}", value.mean(), batch_size=len(prompts), sync_dist=True)

    # ------------------------------------------------------------------ helpers
    def _logprob_gap(self, refined: dict[str, Refinements], rollouts: dict[str, Rollout]) -> torch.Tensor:
        """max |recomputed − captured log p| over every trainable stage: SDE steps and refiner tokens."""
        gaps = [torch.zeros(())]
        for stage in self.stages:
            if stage.trainable and stage.kind == "generator":
                gaps.append(rollouts[stage.name].logprob_gap().cpu())
            elif stage.trainable:
                gaps += [refiner_logprob_gap(self.card[name], refined[name], stage.temperature).cpu()
                         for name in self.plan.refiners_of(stage)]
        return torch.stack(gaps).max()

    def _problems(self, credit: str, refiner_kl: float) -> list[str]:
        problems = self.grpo.problems("workflow_rl", unused=("num_inner_epochs", "num_minibatches"))
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
                problems += sde_problems(stage.rollout_sampler, f"{where}.rollout_sampler")
            if credit == "per_stage" and stage.trainable and stage.credit is None:
                problems.append(f"{where}: credit=per_stage needs the stage's `credit:` reward term (e.g. colour), "
                                f"or use credit: shared")
        if credit not in ("shared", "per_stage"):
            problems.append(f"credit={credit!r}; choose 'shared' or 'per_stage'")
        if refiner_kl < 0:
            problems.append(f"refiner_kl={refiner_kl} must be >= 0")
        if credit == "per_stage" and not problems:
            # per-stage credit reads reward terms: ask the reward once, on a dry run of the chain's media shapes
            media = {s.name: torch.zeros(1, 3, s.frames, s.height, s.width) for s in self.stages
                     if s.kind == "generator"}
            prompts = ["a red circle moving left on a blue background"]
            context = {"original_prompts": prompts, "stages": media,
                       "refinements": {n: [""] for s in self.stages if s.kind == "refiners"
                                       for n in self.plan.refiners_of(s)}}
            needed = [(s.credit, f"stage {s.name!r}: credit", "name one of them, or use credit: shared")
                      for s in trainable if s.credit is not None]
            problems += term_problems(self.reward, needed, media[self.stages[-1].name], prompts, context)
        return problems
