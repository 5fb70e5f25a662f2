"""Joint RL of N prompt-refiner LMs and one generator from one reward (UniRL / PromptRL with N = 1).

Per prompt, K generator samples form a group. For each of its K − s refined samples every refiner LM
samples its own refinement of the prompt (token log-probs captured); the refinements compose, in
refiner order, into the generator prompt; the other s = ``num_skip_refinement`` samples use the
original prompt, so the group contrasts refined against unrefined. All K roll out with the sampler's
SDE step (log p captured), are decoded and scored by one reward; group advantages follow. Each
refiner is updated by the token policy gradient ``-(A·exp(lp - sg(lp)))`` plus a k3 KL to its frozen
reference; the generator by Flow-GRPO's PPO-clip loss on the refined samples plus a KL to its own
reference. ``credit: per_expert`` gives refiner i the advantage of its own reward term;
``joint: false`` freezes the generator (ODE rollout, no optimizer). Each expert has its own optimizer
and learning rate; one iteration = one prompt batch, whatever N. Math: METHODS.md (joint_rl),
``modules/refiners.py``, ``modules/rollout.py``.

    posttrain fit --config configs/joint_rl.yaml          # N = 3, per-expert credit
    posttrain fit --config configs/unified_rl.yaml        # N = 1 (UniRL / PromptRL)
"""
from __future__ import annotations

from typing import Literal, Optional

import torch
from lightning.pytorch.loggers import WandbLogger

from posttrain.callbacks.parity import report_rollout
from posttrain.lit.base import ExpertModule, RunArgs
from posttrain.modules import batch as batch_schema
from posttrain.modules.cards import ModelCard
from posttrain.modules.grpo import GRPOArgs, sde_problems, train_rows
from posttrain.modules.refiners import (
    DEFAULT_TEMPLATE,
    Refinements,
    compose_prompt,
    refiner_c2_gap,
    refiner_loss,
    sample_refinements,
)
from posttrain.modules.rewards import ColourAlignment, Reward, RewardOutput, credited_term, score, term_problems
from posttrain.modules.rollout import Rollout, mean_metrics, train_steps
from posttrain.modules.samplers import FlowMatchSampler


class JointRL(ExpertModule):
    """Args:
        card: needs ``text_encoder``, ``vae``, ``transformer`` and ``num_refiners >= 1`` trainable
            ``qwen2`` refiners (``refiner_0``…). With ``joint`` the transformer is trainable; without,
            it must be ``trainable: false``.
        sampler: the serving sampler (``generate``, validation, sample videos).
        rollout_sampler: what the generator's rollouts run and their recompute reads (its SDE step:
            ``noise_level``, ``sde_window``; its steps and CFG); None = ``sampler`` (train ≡ serve).
        reward: scores decoded videos against the original prompts; reads the refinements from its
            context. None = ``ColourAlignment()``.
        grpo: the GRPO settings (K, timestep fraction, PPO clip, the generator's KL, advantages, which rows
            train, micro-batches of the generator's forward; ``modules.grpo.GRPOArgs``); one update per rollout
            batch (no inner epochs or minibatches).
        num_skip_refinement: how many of the K samples use the original prompt.
        credit: ``shared`` credits every refiner with the total reward's advantage; ``per_expert``
            credits refiner i with the advantage of the reward term named after it.
        generator_term: credit the generator with the advantage of this reward term (e.g. ``colour``,
            the media part of a weighted reward) instead of the total's; None = the total.
        joint: train the generator too; False freezes it (ODE rollout, no optimizer).
        max_new_tokens: longest refinement, in byte tokens.
        temperature: the refiners' sampling temperature.
        refiner_template: the refiners' chat-free context, formatted with ``prompt``.
        refiner_kl: weight of each refiner's k3 KL to its frozen reference.
        table_every_n_iterations: log a W&B table of prompts, refinements and rewards this often.
        run: size of generated videos, seed, NaN tolerance.
    """

    def __init__(self, card: ModelCard, sampler: Optional[FlowMatchSampler] = None,
                 rollout_sampler: Optional[FlowMatchSampler] = None, reward: Optional[Reward] = None,
                 grpo: Optional[GRPOArgs] = None, num_skip_refinement: int = 1,
                 credit: Literal["shared", "per_expert"] = "shared", generator_term: Optional[str] = None,
                 joint: bool = True, max_new_tokens: int = 8, temperature: float = 1.0,
                 refiner_template: str = DEFAULT_TEMPLATE, refiner_kl: float = 0.01,
                 table_every_n_iterations: int = 50, run: Optional[RunArgs] = None):
        super().__init__(card, sampler, run)
        self.rollout_sampler = rollout_sampler or self.sampler
        self.grpo = grpo or GRPOArgs()
        self.reward = reward if reward is not None else ColourAlignment()
        problems = self._problems(card, num_skip_refinement, credit, generator_term, joint, max_new_tokens,
                                  temperature, refiner_template, refiner_kl, table_every_n_iterations,
                                  "rollout_sampler" if rollout_sampler else "sampler")
        if problems:
            raise ValueError("joint_rl:\n  - " + "\n  - ".join(problems))
        self.num_skip_refinement = num_skip_refinement
        self.credit, self.generator_term, self.joint = credit, generator_term, joint
        self.max_new_tokens, self.temperature, self.refiner_template = max_new_tokens, temperature, refiner_template
        self.refiner_kl = refiner_kl
        self.table_every = table_every_n_iterations
        self.policy = self.stage.transformer
        self.reference: Optional[str] = None  # the generator's frozen KL anchor, and each refiner's:
        self.references: dict[str, str] = {}  # added with the card's roles
        self.served: dict[str, str] = {}  # prompt -> composed prompt of the last `generate`

    def setup_roles(self) -> None:
        self.references = {name: self.card.add_role("reference", of=name) for name in self.card.refiners}
        if self.joint and self.grpo.kl_beta > 0:
            self.reference = self.card.add_role("reference", of=self.policy)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        prompts = batch_schema.prompts(batch, "joint_rl")
        grpo, sampler = self.grpo, self.rollout_sampler
        K, S = grpo.num_samples_per_prompt, self.num_skip_refinement
        refiners = self.card.refiners
        # Sample j = b·K + k of prompt b: k < K − S refined, the last S on the original prompt.
        # Group keys come with the batch, the same on every process.
        originals = [p for p in prompts for _ in range(K)]
        group_ids = batch_schema.group_ids(batch, K)
        refined = torch.tensor([b * K + k for b in range(len(prompts)) for k in range(K - S)], device=self.device)

        # 1. refiners sample: each refiner writes its own refinement for every refined sample
        samples: dict[str, Refinements] = {}
        for name in refiners:
            samples[name] = sample_refinements(
                self.card[name], self.card.tokenizers[name], [originals[j] for j in refined.tolist()],
                self.generator, self.max_new_tokens, self.temperature, self.refiner_template)
        texts = {name: [""] * len(originals) for name in refiners}  # "" = no refinement (skip samples)
        for name in refiners:
            for m, j in enumerate(refined.tolist()):
                texts[name][j] = samples[name].texts[m]
        generator_prompts = [compose_prompt(p, [texts[name][j] for name in refiners])
                             for j, p in enumerate(originals)]

        # 2. roll out K samples per prompt: SDE with log p when the generator trains, else the ODE
        cond, uncond = self.conditioning(generator_prompts, sampler)  # B·K rows
        rollout = Rollout.sample(self.stage, sampler, cond, uncond, self.stage.latent_shape(self.video),
                                 self.generator, sde=self.joint)

        # 3. score against the original prompts; group advantages of the total and, per expert, of its term
        videos = self.stage.decode(rollout.latents)  # (B·K, 3, F, H, W) in [-1, 1]
        context = {"original_prompts": originals, "refinements": texts}
        rewards = score(self.reward, videos, generator_prompts, context)
        advantages = grpo.advantages(rewards.total, group_ids).to(self.device)
        credited = {name: advantages for name in refiners}
        if self.credit == "per_expert":
            credited = {name: grpo.advantages(credited_term(rewards, name, "joint_rl"), group_ids).to(self.device)
                        for name in refiners}
        generator_advantages = advantages
        if self.generator_term is not None:
            generator_advantages = grpo.advantages(credited_term(rewards, self.generator_term, "joint_rl"),
                                                   group_ids).to(self.device)
        # C2: before any update, callbacks may recompute every captured log p at the rollout's weights
        report_rollout(self, lambda: self._c2_gap(samples, rollout))

        # 4. update refiners: token PG on each refined sample's completion + k3 KL to the reference.
        #    One backward over all refiners with signal; a refiner whose samples all have A = 0 (on every
        #    process) has no policy gradient this iteration and makes no step (its version does not move).
        refiner_losses, stepping = [], []
        for name in refiners:
            loss, metrics = refiner_loss(self.card, name, self.references[name], samples[name],
                                         credited[name][refined], self.temperature, self.refiner_kl)
            self.log(f"train/loss/{name}", loss.detach(), on_step=True)
            self.log(f"train/kl/{name}", metrics["kl"], on_step=True)
            self.log(f"train/tokens/{name}", metrics["tokens"], on_step=True)
            if self.any_rank(bool((credited[name][refined] != 0).any())):
                refiner_losses.append(loss)
                stepping.append(name)
        if stepping:
            self.step_experts(torch.stack(refiner_losses).sum(), stepping)

        # 5. update generator: Flow-GRPO PPO-clip on the refined samples, credited by the total advantage
        #    (or by its own term's, ``generator_term``); rows with A = 0 are left out (modules/grpo.py's rule)
        if self.joint:
            keep = train_rows(generator_advantages, self.any_rank, self.trainer.world_size > 1,
                              grpo.drop_zero_advantage, candidates=refined)
            self.log(f"train/kept_samples/{self.policy}", float(len(keep)), on_step=True)
            if len(keep):
                steps = train_steps(sampler, grpo.timestep_fraction, self.generator)
                metrics: dict[str, list[torch.Tensor]] = {}
                losses = rollout.select(keep).step_losses(steps, generator_advantages[keep], grpo.clip_range,
                                                          grpo.kl_beta, self.reference, grpo.micro_batch_size, metrics)
                self.step_experts(losses, [self.policy])
                for key, value in mean_metrics(metrics).items():
                    self.log(f"train/{key}/{self.policy}", value, on_step=True)

        # 6. log: rewards, cache, and every so often the refinements as a W&B table
        self.log("train/reward", rewards.total.mean(), prog_bar=True, on_step=True)
        self.log("train/reward_refined", rewards.total[refined].mean(), on_step=True)
        for name, value in rewards.terms.items():
            self.log(f"train/reward/{name}", value.mean(), on_step=True)
        self.log("train/cache_hit_rate", self.card.cache.hit_rate, on_step=True)
        if self.global_step % self.table_every == 0:
            self._log_table(originals, texts, generator_prompts, rewards)
        return rewards.total.mean().detach()

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """Reward of served samples (refine, then ODE) from fixed seeds: comparable across the run."""
        prompts = list(batch["prompt"])
        refinements, composed = self.refine(prompts, seed=batch_idx)
        videos = super().generate(composed, seed=batch_idx)
        rewards = score(self.reward, videos, composed, {"original_prompts": prompts, "refinements": refinements})
        self.log("val/reward", rewards.total.mean(), prog_bar=True, batch_size=len(prompts))
        for name, value in rewards.terms.items():
            self.log(f"val/reward/{name}", value.mean(), batch_size=len(prompts))

    # ------------------------------------------------------------------ serving
    @torch.no_grad()
    def refine(self, prompts: list[str], seed: int = 0) -> tuple[dict[str, list[str]], list[str]]:
        """Each refiner's refinement of each prompt (sampled as in training, from an rng seeded with ``seed``)
        and the composed generator prompts."""
        rng = torch.Generator().manual_seed(seed)
        refinements = {name: sample_refinements(self.card[name], self.card.tokenizers[name], prompts, rng,
                                                self.max_new_tokens, self.temperature, self.refiner_template).texts
                       for name in self.card.refiners}
        composed = [compose_prompt(p, [refinements[n][b] for n in self.card.refiners]) for b, p in enumerate(prompts)]
        return refinements, composed

    @torch.no_grad()
    def generate(self, prompts: list[str], seed: int = 0, latents_only: bool = False) -> torch.Tensor:
        """Serving = the trained system: the refiners refine (seeded by ``seed``), the generator samples."""
        _, composed = self.refine(prompts, seed)
        self.served = dict(zip(prompts, composed))
        return super().generate(composed, seed=seed, latents_only=latents_only)

    def sample_captions(self, prompts: list[str]) -> list[str]:
        """Captions ``prompt → refined prompt`` of the last ``generate`` (read by ``callbacks.SampleVideos``)."""
        return [f"{p} → {self.served.get(p, p)}" for p in prompts]

    # ------------------------------------------------------------------ helpers
    def _problems(self, card, S, credit, generator_term, joint, max_new_tokens, temperature, template, refiner_kl,
                  table_every, sampler_option) -> list[str]:
        """Every configuration problem, collected before anything is built."""
        problems = self.card_problems("joint_rl", trains=())  # the generator trains only when joint
        problems += self.grpo.problems("joint_rl", unused=("num_inner_epochs", "num_minibatches"))
        if card.num_refiners < 1:
            problems.append(f"the card has num_refiners={card.num_refiners}; joint_rl needs >= 1 "
                            f"(`num_refiners: 3` with a `refiner:` template of arch qwen2)")
        for name in card.refiners:
            spec = card.specs[name]
            if spec.arch != "qwen2":
                problems.append(f"{name} has arch {spec.arch!r}; refiners are causal LMs: use arch qwen2")
            if not spec.trainable:
                problems.append(f"{name} is not trainable: set `trainable: true` and give it an optimizer")
        if card.has(self.stage.transformer):
            trainable = card.specs[self.stage.transformer].trainable
            if joint and not trainable:
                problems.append("joint=true trains the generator: set the transformer `trainable: true` and give "
                                "it an optimizer, or set joint: false")
            if not joint and trainable:
                problems.append("joint=false freezes the generator, but the card's transformer is trainable=true: "
                                "set `trainable: false` and remove its optimizer")
        K = self.grpo.num_samples_per_prompt
        if not 0 <= S < K:
            problems.append(f"num_skip_refinement={S} must be in [0, grpo.num_samples_per_prompt={K}): at least one "
                            f"sample per prompt must use the refinements")
        if credit not in ("shared", "per_expert"):
            problems.append(f"credit={credit!r}; choose 'shared' or 'per_expert'")
        if max_new_tokens < 1:
            problems.append(f"max_new_tokens={max_new_tokens} must be >= 1")
        if temperature <= 0:
            problems.append(f"temperature={temperature} must be > 0")
        if "{prompt}" not in template:
            problems.append(f"refiner_template={template!r} must contain '{{prompt}}'")
        if refiner_kl < 0:
            problems.append(f"refiner_kl={refiner_kl} must be >= 0")
        if table_every < 1:
            problems.append(f"table_every_n_iterations={table_every} must be >= 1")
        if joint:
            problems += sde_problems(self.rollout_sampler, sampler_option)
        # credit read from reward terms: ask the reward once, on a dummy sample, for the terms it returns
        needed = [(name, "credit='per_expert'", f"add a RefinementKeyword target for {name} or use credit: shared")
                  for name in card.refiners if credit == "per_expert"]
        needed += [(generator_term, "generator_term", "name one of them or remove generator_term")
                   for _ in range(generator_term is not None)]
        if needed:
            context = {"original_prompts": ["a red circle"], "refinements": {name: [""] for name in card.refiners}}
            problems += term_problems(self.reward, needed, torch.zeros(1, 3, 1, 8, 8), ["a red circle"], context)
        return problems

    def _c2_gap(self, samples: dict[str, Refinements], rollout: Rollout) -> torch.Tensor:
        """max |recomputed − captured log p| over the generator's SDE steps and every refiner's tokens."""
        gaps = [torch.zeros(())] + ([rollout.c2_gap().cpu()] if self.joint else [])
        gaps += [refiner_c2_gap(self.card[name], sample, self.temperature).cpu() for name, sample in samples.items()]
        return torch.stack(gaps).max()

    def _log_table(self, originals, texts, generator_prompts, rewards: RewardOutput) -> None:
        loggers = [lg for lg in (self.loggers or []) if isinstance(lg, WandbLogger)]
        if not loggers or self.global_rank != 0:
            return
        import wandb

        columns = ["prompt", *self.card.refiners, "generator_prompt", "reward"]
        rows = [[originals[j], *[texts[n][j] for n in self.card.refiners], generator_prompts[j],
                 float(rewards.total[j])] for j in range(len(originals))]
        for logger in loggers:
            logger.experiment.log({"train/refinements": wandb.Table(columns=columns, data=rows),
                                   "trainer/global_step": self.global_step})
