"""Joint RL of N prompt-refiner LMs and one generator from one reward (UniRL / PromptRL with N = 1).

Per prompt (a user request), K generator samples form a group. For each of its K − s refined samples every
refiner LM samples its own refinement of the request (token log-probs captured); the refinements compose, in
refiner order, into the prompt the generator is served (``refiners.mode: rewrite``: it replaces the request;
``append``: it follows it; with ``refiners.concerns`` each refiner writes one part of the caption,
``requests.compose_concerns``); the other s = ``refiners.num_unrefined`` samples are served the request verbatim, so
the group contrasts refined against unrefined. The reward scores what the user asked (the batch's facts,
``modules/rewards/intent.py``), never the served text. All K roll out with the sampler's SDE step (log p captured),
are decoded and scored by one reward; group advantages follow. Each refiner is updated by the token policy gradient
``-(A·exp(lp - sg(lp)))`` plus a k3 KL to its frozen reference (``refiners.kl_beta``); the generator by
Flow-GRPO's PPO-clip loss on the refined samples (``generator_rows: faithful``: only those whose served prompt names
what the request asked) plus a KL to its own reference. ``credit: per_expert`` gives
refiner i the advantage of its own reward term; ``joint: false`` freezes the generator (ODE rollout, no optimizer:
prompt-only RL, RePrompt); refiners with ``trainable: false`` are served frozen (generator-only RL through the
refiner). Each expert has its own optimizer and learning rate; one iteration = one prompt batch, whatever N.
Math: docs/methods.md#joint-rl, ``modules/models/refiners.py``, ``modules/rl/rollout.py``.

    posttrain fit --config configs/joint_rl.yaml          # N = 3 on requests, one concern each, per-expert credit
    posttrain fit --config configs/unified_rl.yaml        # N = 1 on requests (UniRL / PromptRL)
    posttrain fit --config configs/prompt_rl.yaml         # N = 1, generator frozen (prompt-only RL)
"""
from __future__ import annotations

from typing import Literal, Optional, Sequence

import torch
from lightning.pytorch.loggers import WandbLogger

from posttrain.callbacks.parity import report_rollout
from posttrain.lit.base import ExpertModule, RunArgs
from posttrain.modules.io import batch as batch_schema
from posttrain.modules.models.cards import ModelCard
from posttrain.modules.rl.grpo import GRPOArgs, sde_problems, train_rows
from posttrain.modules.rl.refiner_args import RefinerArgs
from posttrain.modules.models.refiners import Refinements, refiner_logprob_gap, refiner_loss, sample_refinements
from posttrain.modules.world.requests import CONCERN_TEMPLATES, REWRITE_TEMPLATE, facts_from_batch, faithful_rows, \
    refine as refine_requests, refinement_tokens, serve
from posttrain.modules.world.world import FACTS
from posttrain.modules.rewards.synthetic import ColourAlignment
from posttrain.modules.rewards.base import Reward, RewardOutput, credited_term, score, term_problems
from posttrain.modules.rl.rollout import Rollout, mean_metrics, train_steps
from posttrain.modules.flow.samplers import FlowMatchSampler


class JointRL(ExpertModule):
    """Args:
        card: needs ``text_encoder``, ``vae``, ``transformer`` and ``num_refiners >= 1`` ``qwen2`` refiners
            (``refiner_0``…; ``pretrained: modules/assets/refiner``, the world's refiner). With ``joint`` the
            transformer is trainable; without, it must be ``trainable: false``. A refiner with ``trainable:
            false`` is served as it is (no optimizer, no reference, its version never moves).
        sampler: the serving sampler (``generate``, validation, sample videos).
        rollout_sampler: what the generator's rollouts run and their recompute reads (its SDE step:
            ``noise_level``, ``sde_window``; its steps and CFG); None = ``sampler`` (train ≡ serve).
        reward: scores decoded videos against what the user asked: its context holds the requests
            (``original_prompts``), each refiner's text (``refinements``) and, when the batch carries them
            (``datamodules.Requests``), the requests' ``facts``. None = ``ColourAlignment()``.
        grpo: the GRPO settings (K, timestep fraction, PPO clip, the generator's KL, advantages, which rows
            train, micro-batches of the generator's forward; ``modules.rl.grpo.GRPOArgs``); one update per rollout
            batch (no inner epochs or minibatches).
        refiners: how the refiners write and are served and trained (``modules.rl.refiner_args.RefinerArgs``:
            ``rewrite`` or ``append``, a concern per refiner, token budget, temperature, context template, the KL
            to each one's reference, how many samples are served the request verbatim).
        credit: ``shared`` credits every refiner with the total reward's advantage; ``per_expert``
            credits refiner i with the advantage of the reward term named after it.
        generator_term: credit the generator with the advantage of this reward term (e.g. ``colour``,
            the media part of a weighted reward) instead of the total's; None = the total.
        joint: train the generator too; False freezes it (ODE rollout, no optimizer).
        generator_rows: which refined samples the generator's update may train on: ``refined`` (all of them) or
            ``faithful`` (only those whose served prompt names every fact the request asked, read as the generator's
            captions are, ``requests.rewrite_verdicts``; needs the batch's facts, ``datamodules.Requests``). A wrong
            rewrite's video is scored on the request, so training on it pushes the generator away from drawing
            what its prompt says; ``faithful`` keeps the generator's reward the one of following its prompt.
        shared_noise: the K samples of a request start from one initial noise (common random numbers): within a
            group the rewards then differ by what was served (and, when the generator trains, by its SDE
            noise), not by the draw; False draws each sample's own.
        table_every_n_iterations: log a W&B table of each sample's request, refinements, the prompt the
            generator was served and its reward this often.
        run: size of generated videos, seed, NaN tolerance.
    """

    def __init__(self, card: ModelCard, sampler: Optional[FlowMatchSampler] = None,
                 rollout_sampler: Optional[FlowMatchSampler] = None, reward: Optional[Reward] = None,
                 grpo: Optional[GRPOArgs] = None, refiners: Optional[RefinerArgs] = None,
                 credit: Literal["shared", "per_expert"] = "shared", generator_term: Optional[str] = None,
                 joint: bool = True, generator_rows: Literal["refined", "faithful"] = "refined",
                 shared_noise: bool = False, table_every_n_iterations: int = 50, run: Optional[RunArgs] = None):
        super().__init__(card, sampler, run)
        self.rollout_sampler = rollout_sampler or self.sampler
        self.grpo = grpo or GRPOArgs()
        self.refiner_args = refiners or RefinerArgs()
        self.reward = reward if reward is not None else ColourAlignment()
        problems = self._problems(card, credit, generator_term, joint, table_every_n_iterations,
                                  "rollout_sampler" if rollout_sampler else "sampler")
        if generator_rows not in ("refined", "faithful"):
            problems.append(f"generator_rows={generator_rows!r}; choose 'refined' or 'faithful'")
        if problems:
            raise ValueError("joint_rl:\n  - " + "\n  - ".join(problems))
        self.credit, self.generator_term, self.joint, self.shared_noise = credit, generator_term, joint, shared_noise
        self.generator_rows = generator_rows
        # each refiner's context template and token budget (its task: the whole rewrite or its concern)
        args = self.refiner_args
        tasks = args.concerns or [None] * card.num_refiners
        templates = args.template if isinstance(args.template, list) else [args.template] * len(tasks)
        self.templates = {name: template or (CONCERN_TEMPLATES[task] if task else REWRITE_TEMPLATE)
                          for name, template, task in zip(card.refiners, templates, tasks)}
        self.max_new_tokens = {name: args.max_new_tokens or refinement_tokens(task)
                               for name, task in zip(card.refiners, tasks)}
        self.table_every = table_every_n_iterations
        self.policy = self.stage.transformer
        self.reference: Optional[str] = None  # the generator's frozen KL anchor, and each trained refiner's:
        self.references: dict[str, str] = {}  # added with the card's roles
        self.served: dict[str, str] = {}  # request -> served prompt of the last `generate`

    @property
    def trained_refiners(self) -> list[str]:
        return [name for name in self.card.refiners if self.card.specs[name].trainable]

    def setup_roles(self) -> None:
        self.references = {name: self.card.add_role("reference", of=name) for name in self.trained_refiners}
        if self.joint and self.grpo.kl_beta > 0:
            self.reference = self.card.add_role("reference", of=self.policy)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        prompts = batch_schema.prompts(batch, "joint_rl")
        grpo, sampler = self.grpo, self.rollout_sampler
        K, S = grpo.num_samples_per_prompt, self.refiner_args.num_unrefined
        refiners = self.card.refiners
        # Sample j = b·K + k of request b: k < K − S refined, the last S served the request verbatim.
        # Group keys come with the batch, the same on every process.
        originals = [p for p in prompts for _ in range(K)]
        group_ids = batch_schema.group_ids(batch, K)
        refined = torch.tensor([b * K + k for b in range(len(prompts)) for k in range(K - S)], device=self.device)

        # 1. refiners sample: each refiner writes its own refinement for every refined sample; the served
        #    prompts follow from them (``refiners.mode``, ``refiners.concerns``), an unrefined sample's is the request
        samples = {name: self._sample(name, [originals[j] for j in refined.tolist()], self.generator)
                   for name in refiners}
        texts, served = self._compose(originals, refined, samples)
        is_refined = set(refined.tolist())

        # 2. roll out K samples per request on what was served: SDE with log p when the generator trains,
        #    else the ODE (``shared_noise``: a group's samples start from one draw)
        cond, uncond = self.conditioning(served, sampler)  # B·K rows
        shape = self.stage.latent_shape(self.video)
        noise = None
        if self.shared_noise:  # one draw per request, repeated for its K samples
            noise = torch.randn((len(prompts), *shape), generator=self.generator).repeat_interleave(K, dim=0)
        rollout = Rollout.sample(self.stage, sampler, cond, uncond, shape, self.generator, sde=self.joint, noise=noise)

        # 3. score against what was asked (the requests' facts); group advantages of the total and, per
        #    expert, of its term
        videos = self.stage.decode(rollout.latents)  # (B·K, 3, F, H, W) in [-1, 1]
        rewards = score(self.reward, videos, served, self._context(batch, originals, texts, K))
        advantages = grpo.advantages(rewards.total, group_ids).to(self.device)
        credited = {name: advantages for name in refiners}
        if self.credit == "per_expert":
            credited = {name: grpo.advantages(credited_term(rewards, name, "joint_rl"), group_ids).to(self.device)
                        for name in refiners}
        generator_advantages = advantages
        if self.generator_term is not None:
            generator_advantages = grpo.advantages(credited_term(rewards, self.generator_term, "joint_rl"),
                                                   group_ids).to(self.device)
        # log-probability parity: before any update, callbacks may recompute each captured log p at rollout weights
        report_rollout(self, lambda: self._logprob_gap(samples, rollout))

        # 4. update refiners: token PG on each refined sample's completion + k3 KL to the reference.
        #    One backward over all refiners with signal; a refiner whose samples all have A = 0 (on every
        #    process) has no policy gradient this iteration and makes no step (its version does not move).
        refiner_losses, stepping = [], []
        for name in self.trained_refiners:
            loss, metrics = refiner_loss(self.card, name, self.references[name], samples[name],
                                         credited[name][refined], self.refiner_args.temperature,
                                         self.refiner_args.kl_beta)
            self.log(f"train/loss/{name}", loss.detach(), on_step=True)
            self.log(f"train/kl/{name}", metrics["kl"], on_step=True)
            self.log(f"train/tokens/{name}", metrics["tokens"], on_step=True)
            if self.any_rank(bool((credited[name][refined] != 0).any())):
                refiner_losses.append(loss)
                stepping.append(name)
        if stepping:
            self.step_experts(torch.stack(refiner_losses).sum(), stepping)

        # 5. update generator: Flow-GRPO PPO-clip on the refined samples (``faithful``: only those whose prompt
        #    names what was asked), credited by the total advantage (or by its own term's, ``generator_term``);
        #    rows with A = 0 are left out (modules/rl/grpo.py's rule)
        if self.joint:
            candidates = refined if self.generator_rows == "refined" else self._faithful(batch, refined, served, K)
            keep = train_rows(generator_advantages, self.any_rank, self.trainer.world_size > 1,
                              grpo.drop_zero_advantage, candidates=candidates)
            self.log(f"train/kept_samples/{self.policy}", float(len(keep)), on_step=True)
            if len(keep):
                steps = train_steps(sampler, grpo.timestep_fraction, self.generator)
                metrics: dict[str, list[torch.Tensor]] = {}
                losses = rollout.select(keep).step_losses(steps, generator_advantages[keep], grpo.clip_range,
                                                          grpo.kl_beta, self.reference, grpo.micro_batch_size, metrics)
                self.step_experts(losses, [self.policy])
                for key, value in mean_metrics(metrics).items():
                    self.log(f"train/{key}/{self.policy}", value, on_step=True)

        # 6. log: rewards, cache, and every so often what each sample was served, as a W&B table
        self.log("train/reward", rewards.total.mean(), prog_bar=True, on_step=True)
        self.log("train/reward_refined", rewards.total[refined].mean(), on_step=True)
        for name, value in rewards.terms.items():
            self.log(f"train/reward/{name}", value.mean(), on_step=True)
        self.log("train/cache_hit_rate", self.card.cache.hit_rate, on_step=True)
        if self.global_step % self.table_every == 0:
            self._log_table(originals, texts, is_refined, served, rewards)
        return rewards.total.mean().detach()

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """Reward of served samples (refine, then ODE) from fixed seeds: comparable across the run."""
        prompts = list(batch["prompt"])
        refinements, served = self.refine(prompts, seed=batch_idx)
        videos = super().generate(served, seed=batch_idx)
        rewards = score(self.reward, videos, served, self._context(batch, prompts, refinements, 1))
        self.log("val/reward", rewards.total.mean(), prog_bar=True, batch_size=len(prompts), sync_dist=True)
        for name, value in rewards.terms.items():
            self.log(f"val/reward/{name}", value.mean(), batch_size=len(prompts), sync_dist=True)

    # ------------------------------------------------------------------ serving
    @torch.no_grad()
    def refine(self, prompts: list[str], seed: int = 0) -> tuple[dict[str, list[str]], list[str]]:
        """Each refiner's refinement of each request (``refiners.serve``: sampled as in training, from an rng seeded
        with ``seed``, or greedy) and the prompts the generator is served."""
        rng = torch.Generator().manual_seed(seed)
        temperature = self.refiner_args.temperature if self.refiner_args.serve == "sample" else None  # None: greedy
        refinements = {name: refine_requests(self.card[name], self.card.tokenizers[name], prompts, self.templates[name],
                                             temperature, rng, self.max_new_tokens[name])
                       for name in self.card.refiners}
        served = [self._serve(p, [refinements[n][b] for n in self.card.refiners]) for b, p in enumerate(prompts)]
        return refinements, served

    @torch.no_grad()
    def generate(self, prompts: list[str], seed: int = 0, latents_only: bool = False,
                 images: Optional[torch.Tensor] = None, latents: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Serving = the trained system: the refiners refine (seeded by ``seed``), the generator samples (from
        ``images`` or ``latents`` too for an image-to-video generator, as ``ExpertModule.generate``)."""
        _, served = self.refine(prompts, seed)
        self.served = dict(zip(prompts, served))
        return super().generate(served, seed=seed, latents_only=latents_only, images=images, latents=latents)

    def sample_captions(self, prompts: list[str]) -> list[str]:
        """Captions ``request → served prompt`` of the last ``generate`` (read by ``callbacks.SampleVideos``)."""
        return [f"{p} → {self.served.get(p, p)}" for p in prompts]

    # ------------------------------------------------------------------ helpers
    def _sample(self, name: str, prompts: list[str], rng: torch.Generator) -> Refinements:
        """Refiner ``name``'s refinement of each of ``prompts`` (its template, token budget and the temperature),
        token log-probs captured."""
        return sample_refinements(self.card[name], self.card.tokenizers[name], prompts, rng, self.max_new_tokens[name],
                                  self.refiner_args.temperature, self.templates[name])

    def _compose(self, originals: list[str], refined: torch.Tensor,
                 samples: dict[str, Refinements]) -> tuple[dict[str, list[str]], list[str]]:
        """Each refiner's text per sample ("" for an unrefined one) and the prompt each sample is served: sample
        ``refined[m]`` got refinement m of every refiner, the others the request verbatim."""
        texts = {name: [""] * len(originals) for name in samples}
        for name in samples:
            for m, j in enumerate(refined.tolist()):
                texts[name][j] = samples[name].texts[m]
        is_refined = set(refined.tolist())
        served = [self._serve(p, [texts[name][j] for name in samples] if j in is_refined else None)
                  for j, p in enumerate(originals)]
        return texts, served

    def _serve(self, request: str, refinements: Optional[Sequence[str]]) -> str:
        """The prompt the generator is served for ``request`` and the refiners' texts (None: an unrefined sample)."""
        return serve(request, refinements, self.refiner_args.mode, self.refiner_args.concerns)

    @staticmethod
    def _context(batch: dict, originals: list[str], texts: dict[str, list[str]], repeats: int) -> dict:
        """The reward's context: the requests, each refiner's text and, when the batch carries them, the
        requests' facts (one per sample: each request's repeated ``repeats`` times)."""
        context = {"original_prompts": originals, "refinements": texts}
        if all(fact in batch for fact in FACTS):
            context["facts"] = [f for f in facts_from_batch(batch) for _ in range(repeats)]
        return context

    @staticmethod
    def _faithful(batch: dict, refined: torch.Tensor, served: list[str], repeats: int) -> torch.Tensor:
        """The refined samples whose served prompt names every fact their request asked (``generator_rows``)."""
        if not all(fact in batch for fact in FACTS):
            raise ValueError("joint_rl: generator_rows='faithful' reads the requests' facts from the batch; load "
                             "requests with datamodules.Requests, or set generator_rows: refined")
        facts = [f for f in facts_from_batch(batch) for _ in range(repeats)]
        rows = refined.tolist()
        return refined[faithful_rows([served[j] for j in rows], [facts[j] for j in rows]).to(refined.device)]

    def _problems(self, card, credit, generator_term, joint, table_every, sampler_option) -> list[str]:
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
        trains_refiner = any(card.specs[name].trainable for name in card.refiners)
        if card.has(self.stage.transformer):
            trainable = card.specs[self.stage.transformer].trainable
            if joint and not trainable:
                problems.append("joint=true trains the generator: set the transformer `trainable: true` and give "
                                "it an optimizer, or set joint: false")
            if not joint and trainable:
                problems.append("joint=false freezes the generator, but the card's transformer is trainable=true: "
                                "set `trainable: false` and remove its optimizer")
        if card.num_refiners and not joint and not trains_refiner:
            problems.append("nothing trains: joint=false freezes the generator and every refiner is trainable=false; "
                            "set the refiner `trainable: true` with an optimizer, or joint: true")
        problems += self.refiner_args.problems(card.refiners, self.grpo.num_samples_per_prompt,
                                               getattr(self.reward, "concerns", None))
        if credit not in ("shared", "per_expert"):
            problems.append(f"credit={credit!r}; choose 'shared' or 'per_expert'")
        if table_every < 1:
            problems.append(f"table_every_n_iterations={table_every} must be >= 1")
        if joint:
            problems += sde_problems(self.rollout_sampler, sampler_option)
        # credit read from reward terms: ask the reward once, on a dummy sample, for the terms it returns
        needed = [(name, "credit='per_expert'",
                   "score each refiner's own part (IntentReward(concerns=...), RefinementKeyword) or use credit: shared")
                  for name in card.refiners if credit == "per_expert"]
        needed += [(generator_term, "generator_term", "name one of them or remove generator_term")
                   for _ in range(generator_term is not None)]
        if needed:
            context = {"original_prompts": ["a red circle"], "refinements": {name: [""] for name in card.refiners}}
            problems += term_problems(self.reward, needed, torch.zeros(1, 3, 1, 8, 8), ["a red circle"], context)
        return problems

    def _logprob_gap(self, samples: dict[str, Refinements], rollout: Rollout) -> torch.Tensor:
        """max |recomputed − captured log p| over the generator's SDE steps and every refiner's tokens."""
        gaps = [torch.zeros(())] + ([rollout.logprob_gap().cpu()] if self.joint else [])
        gaps += [refiner_logprob_gap(self.card[name], sample, self.refiner_args.temperature).cpu()
                 for name, sample in samples.items()]
        return torch.stack(gaps).max()

    def served_table(self, originals: list[str], texts: dict[str, list[str]], refined: set[int], served: list[str],
                     rewards: RewardOutput) -> tuple[list[str], list[list]]:
        """The columns and rows of the samples table: per sample its request, whether it was refined, each
        refiner's text, the prompt the generator was served (the very strings its conditioning was made from)
        and its reward."""
        columns = ["request", "refined", *self.card.refiners, "served", "reward"]
        rows = [[originals[j], j in refined, *[texts[n][j] for n in self.card.refiners], served[j],
                 float(rewards.total[j])] for j in range(len(originals))]
        return columns, rows

    def _log_table(self, originals, texts, refined, served, rewards: RewardOutput) -> None:
        loggers = [lg for lg in (self.loggers or []) if isinstance(lg, WandbLogger)]
        if not loggers or self.global_rank != 0:
            return
        import wandb

        columns, rows = self.served_table(originals, texts, refined, served, rewards)
        for logger in loggers:
            logger.experiment.log({"train/refinements": wandb.Table(columns=columns, data=rows),
                                   "trainer/global_step": self.global_step})
