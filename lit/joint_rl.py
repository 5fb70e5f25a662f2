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
import torch.distributed as dist
from lightning.pytorch.loggers import WandbLogger

from posttrain.callbacks.parity import report_rollout
from posttrain.lit.base import ExpertModule, RunArgs
from posttrain.modules.advantages import group_advantages
from posttrain.modules.cards import ModelCard
from posttrain.modules.refiners import (
    DEFAULT_TEMPLATE,
    Refinements,
    completion_log_probs,
    compose_prompt,
    k3_kl,
    sample_refinements,
    token_pg_loss,
)
from posttrain.modules.rewards import ColourAlignment, Reward, RewardOutput, score, term_of
from posttrain.modules.rollout import c2_gap, mean_metrics, ppo_step_losses, rollout, train_steps
from posttrain.modules.samplers import FlowMatchSampler


class JointRL(ExpertModule):
    """Args:
        card: needs ``text_encoder``, ``vae``, ``transformer`` and ``num_refiners >= 1`` trainable
            ``qwen2`` refiners (``refiner_0``…). With ``joint`` the transformer is trainable; without,
            it must be ``trainable: false``.
        sampler: the serving sampler; rollouts use its SDE step (``noise_level``, ``sde_window``).
        reward: scores decoded videos against the original prompts; reads the refinements from its
            context. None = ``ColourAlignment()``.
        num_samples_per_prompt: K, the group size.
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
        timestep_fraction: share of the SDE steps the generator trains on per iteration.
        clip_range: the generator's PPO ε.
        kl_beta: weight of the generator's KL to its frozen reference; 0 adds no reference.
        guidance_scale: CFG of rollouts and their recompute (1 = no unconditional pass).
        advantage_std: normalize advantages by the group's std or the whole batch's.
        adv_clip: advantages are clipped to ±adv_clip.
        table_every_n_iterations: log a W&B table of prompts, refinements and rewards this often.
        micro_batch_size: rows per training forward of the generator (as flow_grpo's: the same update, activation
            memory of that many rows); None = every kept sample at once.
        run: size of generated videos, seed, NaN tolerance.
    """

    def __init__(self, card: ModelCard, sampler: Optional[FlowMatchSampler] = None, reward: Optional[Reward] = None,
                 num_samples_per_prompt: int = 4, num_skip_refinement: int = 1,
                 credit: Literal["shared", "per_expert"] = "shared", generator_term: Optional[str] = None,
                 joint: bool = True,
                 max_new_tokens: int = 8, temperature: float = 1.0, refiner_template: str = DEFAULT_TEMPLATE,
                 refiner_kl: float = 0.01, timestep_fraction: float = 0.5, clip_range: float = 1e-3,
                 kl_beta: float = 0.004, guidance_scale: float = 1.0,
                 advantage_std: Literal["group", "global"] = "group", adv_clip: float = 5.0,
                 table_every_n_iterations: int = 50, micro_batch_size: Optional[int] = None,
                 run: Optional[RunArgs] = None):
        super().__init__(card, sampler, run)
        self.reward = reward if reward is not None else ColourAlignment()
        problems = self._problems(card, num_samples_per_prompt, num_skip_refinement, credit, generator_term, joint,
                                  max_new_tokens, temperature, refiner_template, refiner_kl, timestep_fraction,
                                  clip_range, kl_beta, table_every_n_iterations)
        if micro_batch_size is not None and micro_batch_size < 1:
            problems.append(f"micro_batch_size={micro_batch_size} must be >= 1 (rows per training forward; null: all)")
        if problems:
            raise ValueError("joint_rl:\n  - " + "\n  - ".join(problems))
        self.num_samples_per_prompt, self.num_skip_refinement = num_samples_per_prompt, num_skip_refinement
        self.credit, self.generator_term, self.joint = credit, generator_term, joint
        self.max_new_tokens, self.temperature, self.refiner_template = max_new_tokens, temperature, refiner_template
        self.refiner_kl = refiner_kl
        self.timestep_fraction, self.clip_range, self.kl_beta = timestep_fraction, clip_range, kl_beta
        self.guidance_scale = guidance_scale
        self.advantage_std, self.adv_clip = advantage_std, adv_clip
        self.table_every = table_every_n_iterations
        self.micro_batch_size = micro_batch_size
        self.served: dict[str, str] = {}  # prompt -> composed prompt of the last `generate`

    def setup_roles(self) -> None:
        for name in self.card.refiners:
            self.card.add_role("reference", of=name)
        if self.joint and self.kl_beta > 0:
            self.card.add_role("reference", of="transformer")

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        prompts = list(batch["prompt"])
        if not prompts:
            raise ValueError("joint_rl: the batch holds no prompts")
        K, S = self.num_samples_per_prompt, self.num_skip_refinement
        refiners = self.card.refiners
        # Sample j = b·K + k of prompt b: k < K − S refined, the last S on the original prompt.
        # Group ids are the prompts' dataset indices, the same on every process.
        originals = [p for p in prompts for _ in range(K)]
        group_ids = torch.as_tensor(batch["seed"]).repeat_interleave(K)
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
        cond, uncond = self.conditioning(generator_prompts, self.guidance_scale)  # B·K rows
        traj = rollout(self.stage, self.sampler, cond, self.stage.latent_shape(self.video), self.generator,
                       sde=self.joint, uncond=uncond, guidance_scale=self.guidance_scale)

        # 3. score against the original prompts; group advantages of the total and, per expert, of its term
        videos = self.stage.decode(traj.latents)  # (B·K, 3, F, H, W) in [-1, 1]
        context = {"original_prompts": originals, "refinements": texts}
        rewards = score(self.reward, videos, generator_prompts, context)
        advantages = group_advantages(rewards.total, group_ids, self.advantage_std, self.adv_clip).to(self.device)
        credited = {name: advantages for name in refiners}
        if self.credit == "per_expert":
            credited = {name: group_advantages(self._term(rewards, name), group_ids, self.advantage_std,
                                               self.adv_clip).to(self.device) for name in refiners}
        generator_advantages = advantages
        if self.generator_term is not None:
            generator_advantages = group_advantages(self._term(rewards, self.generator_term), group_ids,
                                                    self.advantage_std, self.adv_clip).to(self.device)
        # C2: before any update, callbacks may recompute every captured log p at the rollout's weights
        report_rollout(self, lambda: self._c2_gap(samples, traj, cond, uncond))

        # 4. update refiners: token PG on each refined sample's completion + k3 KL to the reference.
        #    One backward over all refiners with signal; a refiner whose samples all have A = 0 has no
        #    policy gradient this iteration and makes no step (its version does not move).
        refiner_losses, stepping = [], []
        for name in refiners:
            sample = samples[name]
            log_probs = completion_log_probs(self.card[name], sample, self.temperature)  # (M, T), grad
            with torch.no_grad(), self.card.use(f"{name}_reference") as reference:  # a LoRA's: adapter off
                ref_log_probs = completion_log_probs(reference, sample, self.temperature)
            pg, pg_metrics = token_pg_loss(log_probs, credited[name][refined], sample.mask)
            kl, _ = k3_kl(log_probs, ref_log_probs, sample.mask)
            loss = pg.mean() + self.refiner_kl * kl.mean()
            self.log(f"train/loss/{name}", loss.detach(), on_step=True)
            self.log(f"train/kl/{name}", kl.detach().mean(), on_step=True)
            self.log(f"train/tokens/{name}", pg_metrics["tokens"], on_step=True)
            if self.any_rank(bool((credited[name][refined] != 0).any())):
                refiner_losses.append(loss)
                stepping.append(name)
        if stepping:
            self.step_experts(torch.stack(refiner_losses).sum(), stepping)

        # 5. update generator: Flow-GRPO PPO-clip on the refined samples, credited by the total advantage
        #    (or by its own term's, ``generator_term``)
        keep = refined[generator_advantages[refined] != 0]
        if self.joint and self.any_rank(len(keep) > 0):
            keep = keep if len(keep) else refined  # signal on another rank only: A = 0 here, the KL remains
            steps = train_steps(self.sampler, self.timestep_fraction, self.generator)
            metrics: dict[str, list[torch.Tensor]] = {}
            self.step_experts(ppo_step_losses(self.stage, self.sampler, traj, steps, cond, generator_advantages,
                                              self.clip_range, self.kl_beta, uncond, self.guidance_scale, index=keep,
                                              reference="transformer_reference" if self.kl_beta > 0 else None,
                                              metrics=metrics, micro_batch=self.micro_batch_size), ["transformer"])
            metrics = mean_metrics(metrics)
            self.log("train/loss/transformer", metrics["loss"], on_step=True)
            self.log("train/ppo_ratio_mean", metrics["ratio_mean"], on_step=True)
            self.log("train/clip_frac", metrics["clip_frac"], on_step=True)
            self.log("train/kl/transformer", metrics["kl"], on_step=True)

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
        """Each refiner's refinement of each prompt (sampled as in training, from its own seeded generator)
        and the composed generator prompts."""
        generator = torch.Generator().manual_seed(seed)
        refinements = {name: sample_refinements(self.card[name], self.card.tokenizers[name], prompts, generator,
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
    def _problems(self, card, K, S, credit, generator_term, joint, max_new_tokens, temperature, template, refiner_kl,
                  timestep_fraction, clip_range, kl_beta, table_every) -> list[str]:
        """Every configuration problem, collected before anything is built."""
        problems = self.card_problems("joint_rl", trains=())  # the generator trains only when joint
        if card.num_refiners < 1:
            problems.append(f"the card has num_refiners={card.num_refiners}; joint_rl needs >= 1 "
                            f"(`num_refiners: 3` with a `refiner:` template of arch qwen2)")
        for name in card.refiners:
            spec = card.specs[name]
            if spec.arch != "qwen2":
                problems.append(f"{name} has arch {spec.arch!r}; refiners are causal LMs: use arch qwen2")
            if not spec.trainable:
                problems.append(f"{name} is not trainable: set `trainable: true` and give it an optimizer")
        if card.has("transformer"):
            trainable = card.specs["transformer"].trainable
            if joint and not trainable:
                problems.append("joint=true trains the generator: set the transformer `trainable: true` and give "
                                "it an optimizer, or set joint: false")
            if not joint and trainable:
                problems.append("joint=false freezes the generator, but the card's transformer is trainable=true: "
                                "set `trainable: false` and remove its optimizer")
        if K < 2:
            problems.append(f"num_samples_per_prompt={K} must be >= 2: group advantages compare K samples of a prompt "
                            f"(Flow-GRPO uses 8 to 24)")
        if not 0 <= S < K:
            problems.append(f"num_skip_refinement={S} must be in [0, num_samples_per_prompt={K}): at least one "
                            f"sample per prompt must use the refinements")
        if credit not in ("shared", "per_expert"):
            problems.append(f"credit={credit!r}; choose 'shared' or 'per_expert'")
        if max_new_tokens < 1:
            problems.append(f"max_new_tokens={max_new_tokens} must be >= 1")
        if temperature <= 0:
            problems.append(f"temperature={temperature} must be > 0")
        if "{prompt}" not in template:
            problems.append(f"refiner_template={template!r} must contain '{{prompt}}'")
        if refiner_kl < 0 or kl_beta < 0:
            problems.append(f"refiner_kl={refiner_kl} and kl_beta={kl_beta} must be >= 0")
        if not 0.0 < timestep_fraction <= 1.0:
            problems.append(f"timestep_fraction={timestep_fraction} must be in (0, 1]")
        if clip_range <= 0:
            problems.append(f"clip_range={clip_range} must be > 0 (PPO's ε; the default is 1e-3)")
        if table_every < 1:
            problems.append(f"table_every_n_iterations={table_every} must be >= 1")
        if joint and not bool(self.sampler.sde_steps().any()):
            problems.append("the sampler's sde_window holds no step")
        needed = [(name, "credit='per_expert'") for name in card.refiners if credit == "per_expert"]
        needed += [(generator_term, "generator_term") for _ in range(generator_term is not None)]
        if needed:
            problems += self._missing_terms(needed, card.refiners)
        return problems

    def _missing_terms(self, needed: list[tuple[str, str]], refiners: list[str]) -> list[str]:
        """Credit read from reward terms: ask the reward once, on a dummy sample, for the terms it returns."""
        context = {"original_prompts": ["a red circle"], "refinements": {name: [""] for name in refiners}}
        try:
            out = score(self.reward, torch.zeros(1, 3, 1, 8, 8), ["a red circle"], context)
        except Exception as err:  # noqa: BLE001 - reported as a config problem, with the reward's own message
            return [f"{needed[0][1]}: the reward failed on a dry run ({type(err).__name__}: {err})"]
        problems = []
        for term, option in needed:
            try:
                term_of(out, term)
            except KeyError:
                fix = (f"add a RefinementKeyword target for {term} or use credit: shared" if term in refiners
                       else "name one of them or remove generator_term")
                problems.append(f"{option} needs a reward term for {term!r}, but the reward's terms are "
                                f"{sorted(out.terms)}: {fix}")
        return problems

    def _term(self, rewards: RewardOutput, name: str) -> torch.Tensor:
        try:
            return term_of(rewards, name)
        except KeyError as err:
            raise ValueError(f"joint_rl credit by reward term: {err.args[0]}") from err

    def _c2_gap(self, samples: dict[str, Refinements], traj, cond, uncond) -> torch.Tensor:
        """max |recomputed − captured log p| over the generator's SDE steps and every refiner's tokens."""
        gaps = [torch.zeros(())]
        if self.joint:
            gaps.append(c2_gap(self.stage, self.sampler, traj, cond, uncond, self.guidance_scale).cpu())
        with torch.no_grad():
            for name, sample in samples.items():
                recomputed = completion_log_probs(self.card[name], sample, self.temperature)
                gaps.append((recomputed - sample.log_probs).abs().max().cpu())
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
