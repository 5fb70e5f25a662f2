"""The thin base every method stands on: one optimizer per trainable expert, stepped by hand, and serving.

It owns what *every* method needs and nothing a method's algorithm is made of:
- ``configure_optimizers``: one optimizer (and optional scheduler) per trainable expert of the card;
- ``step_experts(losses, experts)``: back the loss (or a list of per-step losses, one at a time) up into
  ``experts`` only — a loss whose graph reaches another trainable expert is refused before its backward —
  then per expert accumulation, gradient clipping, a non-finite guard and the optimizer step, logging
  ``train/grad_norm/<expert>``, ``train/lr/<expert>``;
- ``generate``: the serving path (the one sampler, through the generator stage), used by ``predict``,
  sample logging and evaluation.

The plumbing behind it lives in ``lit/engine/`` and ``callbacks/``: exact resume and the RNG discipline
(``engine/resume.py``, a mixin), the logging cadence (``engine/log_cadence.py``, a mixin), the start-up checks
of the trainer (``engine/startup.py``), iterations (``callbacks.IterationCounter``: Lightning counts every
``optimizer.step()`` in ``global_step``; here ``max_steps``, logging and checkpoint cadence count iterations),
weight versions (``callbacks.WeightVersions``), precomputed rows (``callbacks.PrecomputedRows``) and frozen
encoders kept in host memory (``engine/encoders.py``).
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence, Union

import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning

from posttrain.callbacks.iterations import IterationCounter
from posttrain.callbacks.precomputed import PrecomputedRows
from posttrain.callbacks.versions import WeightVersions
from posttrain.lit.engine.encoders import ddp_ignore, offload_encoders
from posttrain.lit.engine.log_cadence import DeferredLogging
from posttrain.lit.engine.resume import ExactResume
from posttrain.lit.engine.startup import check_trainer
from posttrain.modules.flow.conditioning import Conditioning
from posttrain.modules.io import batch as batch_schema
from posttrain.modules.models import presets
from posttrain.modules.models.cards import ModelCard
from posttrain.modules.models.distributed import any_rank, world_size
from posttrain.modules.models.generators import GeneratorStage, VideoSize
from posttrain.modules.flow.samplers import FlowMatchSampler
from posttrain.modules.models.versions import SyncPlan, constant

# Frozen experts are in eval mode on purpose (no dropout: the same input gives the same output); Lightning
# warns about any module in eval mode when fit starts. This filter drops exactly that warning.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training",
                        category=PossibleUserWarning)

# one scalar loss, or per-step losses computed one at a time (each backed up before the next is computed)
Losses = Union[torch.Tensor, Sequence[Callable[[], torch.Tensor]]]


class NonFiniteLossError(RuntimeError):
    pass


class GradientLeakError(RuntimeError):
    pass


@dataclass
class RunArgs:
    """Settings every method shares (grouped once, as litgpt groups its arguments).

    Args:
        frames, height, width: pixel size of what the method generates (rollouts, sample videos,
            ``predict``); a video datamodule takes the same size (the CLI links them).
        seed: seed of the method's own noise generator (offset by the process rank); None = the CLI's
            ``seed_everything`` (so ``--seed_everything 1`` reseeds the whole run), 0 outside the CLI.
        max_nan_steps: stop after this many iterations in a row whose loss was not finite.
        embedded_guidance: the guidance value a guidance-distilled generator embeds (FLUX-dev;
            FluxPipeline's ``guidance_scale``); None = the generator adapter's default; generators without a
            guidance embedding ignore it.
    """

    frames: int = 9
    height: int = 32
    width: int = 32
    seed: Optional[int] = None
    max_nan_steps: int = 3
    embedded_guidance: Optional[float] = None

    @property
    def video(self) -> VideoSize:
        return VideoSize(self.frames, self.height, self.width)


class ExpertModule(ExactResume, DeferredLogging):
    """Base of every method. Subclasses write ``training_step`` as their algorithm.

    The two mixins are LightningModules' own hooks (exact resume and the RNG discipline; ``log`` at the loggers'
    cadence), each one concern in ``lit/engine/``: Lightning reaches a module only through its hooks, and these
    must run in the module's slot (after every callback's, and ``on_load_checkpoint`` before the weights load).

    Args:
        card: the experts.
        sampler: the serving sampler (``predict``, sample logging); rollouts use it with ``sde=True``.
        run: size of generated videos, seed, NaN tolerance.
    """

    # Whether the training forward of an RL update runs through the rollout sampler's guidance (two rows per sample
    # when its CFG scale is not 1), as a PPO ratio recomputes each rollout step; a method whose update is a plain
    # forward of the policy (DiffusionNFT) sets False. ``posttrain estimate`` sizes the update's activations by it.
    update_runs_rollout_cfg: bool = True
    # Whether the method trains a pair of noise experts (``transformer``, ``transformer_2``: whichever of them are
    # trainable, each on the rows or steps of its range). One that does not refuses a card whose pair has a trainable
    # expert at start-up.
    trains_pair: bool = False

    def __init__(self, card: ModelCard, sampler: Optional[FlowMatchSampler] = None, run: Optional[RunArgs] = None):
        super().__init__()
        self.automatic_optimization = False
        self.card = card
        self.sampler = sampler or FlowMatchSampler()
        self.run = run or RunArgs()
        if self.run.seed is None:
            self.run = replace(self.run, seed=0)
        # the card's generator: transformer + vae + its text encoders (+ an image encoder), through its adapter
        self.stage = GeneratorStage(card, embedded_guidance=self.run.embedded_guidance,
                                    num_train_timesteps=self.sampler.num_train_timesteps)
        self.sync_plans: list[SyncPlan] = []
        self.stepped: set[str] = set()  # experts whose optimizer stepped in this iteration
        self._micro: dict[str, int] = {}  # expert -> backward passes so far (accumulation)
        self._nan_streak: dict[str, int] = {}  # expert -> iterations in a row with a non-finite loss
        # the method's noise: one stream per process (seeded with the rank at setup), and one for the draws every
        # process must agree on (e.g. Self-Forcing's exit step), seeded alike on all ranks
        self.generator = torch.Generator().manual_seed(self.run.seed)
        self.shared_generator = torch.Generator().manual_seed(self.run.seed)

    @property
    def video(self) -> VideoSize:
        return self.run.video

    @property
    def policies(self) -> list[str]:
        """The generator experts that train: the stage's transformer, or those of a pair of noise experts
        (``transformer``, ``transformer_2``) that are trainable."""
        return [name for name in self.stage.generators if name in self.card.specs and self.card.specs[name].trainable]

    def card_problems(self, method: str, trains: tuple[str, ...] = ("transformer",)) -> list[str]:
        """The card-shape problems of a method that trains ``trains`` with the card's generator stage."""
        problems = [p for p in self.stage.problems()]
        problems += [f"the card has no {name!r}" for name in trains if not self.card.has(name)
                     and f"the card has no {name!r}" not in problems]
        pair = self.stage.transformer_2 is not None
        problems += [f"{method} trains `{name}`: set `trainable: true` and give it an optimizer"
                     for name in trains if name in self.card.specs and not self.card.specs[name].trainable
                     and not (pair and self.trains_pair and name == self.stage.transformer)]
        if pair and self.trains_pair and self.stage.transformer in trains and not self.policies:
            problems.append(f"{method} trains the pair {list(self.stage.generators)}: set `trainable: true` and give "
                            f"an optimizer to one or both")
        if pair and not self.trains_pair and self.policies:
            problems.append(f"{method} trains one generator, but the card's is a pair of noise experts "
                            f"{list(self.stage.generators)} (boundary_ratio={self.card.boundary_ratio}) with "
                            f"{self.policies} trainable: finetune, flow_grpo and diffusion_nft train a pair (dmd2 "
                            f"distills from one as its frozen teacher, `teacher` and `teacher_2`)")
        generator = self.card.specs.get(self.stage.transformer)
        if self.sampler.chunk_frames is not None and generator is not None \
                and not presets.causal(generator.arch):
            problems.append(f"sampler.chunk_frames={self.sampler.chunk_frames} samples chunk by chunk with a KV "
                            f"cache, but `{self.stage.transformer}` has arch {generator.arch!r}, which is not "
                            f"block-causal: set `arch: wan_t2v_causal`, or sampler.chunk_frames: null")
        if self.run.max_nan_steps < 1:
            problems.append(f"run.max_nan_steps={self.run.max_nan_steps} must be >= 1")
        samplers = {"sampler": self.sampler, "rollout_sampler": getattr(self, "rollout_sampler", None)}
        problems += [f"{key}.guidance_scale_2={sampler.guidance_scale_2} guides the low-noise expert of a pair of "
                     f"noise experts, but `{self.stage.transformer}` has none (no `{self.stage.transformer}_2`, "
                     f"boundary_ratio): drop guidance_scale_2" for key, sampler in samplers.items()
                     if sampler is not None and sampler.guidance_scale_2 is not None and not pair]
        return problems

    # ------------------------------------------------------------------ setup
    def configure_model(self) -> None:
        if not self.card.built:
            # a sharding strategy builds its sharded experts itself (partitioned under deepspeed.zero.Init)
            # and gathers them while roles copy them
            strategy = self._strategy
            self.card.build(build_expert=getattr(strategy, "build_expert", None))
            gathered = getattr(strategy, "gathered_experts", lambda card: contextlib.nullcontext())
            with gathered(self.card):
                self.setup_roles()
        self.check_sizes()
        if self.card.unloaded:  # meta tensors: nothing for DDP to broadcast or check
            ddp_ignore(self, self.card.unloaded)
        offloaded = [name for name, spec in self.card.specs.items() if spec.offload_weights]
        if offloaded and self._trainer is not None:  # before the strategy moves the module: they stay on the host
            for name in offloaded:
                self.card.park(name, self.trainer.strategy.root_device)
            ddp_ignore(self, offloaded)
        swapping = [name for name, spec in self.card.specs.items() if spec.swap_blocks]
        if swapping and self._trainer is not None:  # before the strategy moves the module, as parking
            for name in swapping:
                ddp_ignore(self, tensors=self.card.swap(name, self.trainer.strategy.root_device).groups)
        if self.card.offload_encoders and self._trainer is not None and self.trainer.state.fn == "fit":
            offload_encoders(self)  # before the strategy moves the module: parked encoders never reach the device

    def check_sizes(self) -> None:
        """A size the VAE and the patch size cannot take stops here, at start-up, and so does a chunk size
        that does not divide the latent frames."""
        shape = self.stage.latent_shape(self.video)
        chunk = self.sampler.chunk_frames
        if chunk is not None and shape[1] % chunk:
            raise ValueError(f"sampler.chunk_frames={chunk} does not divide the {shape[1]} latent frames of "
                             f"run.frames={self.video.frames}: choose a divisor of {shape[1]}, or frames giving a "
                             f"multiple of {chunk} latent frames")

    def setup_roles(self) -> None:
        """Methods add frozen roles (``card.add_role``) and sync plans here, after the card is built."""

    def setup(self, stage: str) -> None:
        check_trainer(self.trainer, self.card)
        super().setup(stage)  # ExactResume: per-process noise, verified checkpoint folders

    def any_rank(self, flag: bool) -> bool:
        """``flag`` on any process. Under DDP every rank must run the same backward passes, so methods
        decide together whether an expert updates."""
        return any_rank(flag, self.device)

    def experts_that_ran(self, timesteps: Sequence[float]) -> list[str]:
        """The generator experts that train and ran at one of ``timesteps`` (host values) on any process: ``policies``
        at once for one generator; of a pair, each trained expert whose range holds one of them, decided together
        (one all-reduce of a mask) so that every process steps the same experts."""
        if self.stage.transformer_2 is None:
            return self.policies
        ran = {self.stage.expert_at(float(t)) for t in timesteps}
        flags = [name in ran for name in self.policies]
        if world_size() > 1:
            mask = torch.tensor(flags, dtype=torch.float32, device=self.device)
            torch.distributed.all_reduce(mask, op=torch.distributed.ReduceOp.MAX)
            flags = (mask > 0).tolist()
        return [name for name, flag in zip(self.policies, flags) if flag]

    def add_policy_roles(self, role: str, decay: Optional[Callable[[int], float]] = None) -> str:
        """Add ``role`` of each generator expert that trains (``card.add_role``), blended toward its expert by a sync
        plan with ``decay`` when given, and return the name that runs them: the copy of the one generator, or of a
        pair the first trained expert's (running either copy runs the pair, each expert through its own copy where it
        has one and a frozen expert as itself: ``GeneratorStage.pair_of``)."""
        names = []
        for policy in self.policies:
            names.append(self.card.add_role(role, of=policy))
            if decay is not None:
                self.sync_plans.append(SyncPlan(policy, names[-1], decay))
        return names[0]

    def configure_callbacks(self):
        return [IterationCounter(), WeightVersions(), PrecomputedRows()]

    @property
    def _strategy(self):
        """The trainer's strategy, or None outside a trainer (a card built or inspected on its own)."""
        return self._trainer.strategy if self._trainer is not None else None

    @property
    def engine_experts(self) -> dict[str, Any]:
        """Experts whose optimizer lives in a DeepSpeed engine of the strategy (name -> engine)."""
        return getattr(self._strategy, "engines", {})

    @property
    def plain_trainable(self) -> list[str]:
        """Trainable experts with a plain optimizer from ``configure_optimizers``, in card order."""
        return [name for name in self.card.trainable if name not in self.engine_experts]

    def configure_optimizers(self):
        configs = []
        for name in self.plain_trainable:
            spec = self.card.specs[name]
            optimizer = self.card.optimizer_for(name, self.card.parameters_of(name))
            config: dict[str, Any] = {"optimizer": optimizer}
            if spec.scheduler is not None:
                config["lr_scheduler"] = {"scheduler": spec.scheduler(optimizer), "interval": "step",
                                          "name": f"lr/{name}"}
            configs.append(config)
        return configs  # empty when DeepSpeed's engines hold every optimizer (None would warn "no optimizer")

    # ------------------------------------------------------------------ experts
    def optimizer_of(self, name: str) -> torch.optim.Optimizer:
        if name in self.engine_experts:
            return self.engine_experts[name].optimizer
        optimizers = self.optimizers(use_pl_optimizer=False)
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        return optimizers[self.plain_trainable.index(name)]

    def scheduler_of(self, name: str):
        if self.card.specs[name].scheduler is None:
            return None
        if name in self.engine_experts:
            return self.engine_experts[name].lr_scheduler
        with_sched = [n for n in self.plain_trainable if self.card.specs[n].scheduler is not None]
        schedulers = self.lr_schedulers()
        schedulers = schedulers if isinstance(schedulers, list) else [schedulers]
        return schedulers[with_sched.index(name)]

    def backward_experts(self, loss: torch.Tensor, experts: list[str], last: bool = True) -> None:
        """One backward for ``experts``; a sharded strategy routes it through their DeepSpeed engines
        (``last``: the final backward of this iteration, DeepSpeed's accumulation boundary)."""
        strategy = self.trainer.strategy
        if hasattr(strategy, "expert_backward"):
            strategy.expert_backward(self, loss, experts, last=last)
        else:
            self.manual_backward(loss)

    def step_experts(self, losses: Losses, experts: list[str]) -> bool:
        """Back ``losses`` up into ``experts`` and step every one of them that is due; False if skipped.

        ``losses`` is one scalar, or a list of zero-argument callables each returning a scalar (the
        per-step losses of a rollout): each is computed and backed up before the next is computed, so
        activation memory holds one of them (gradients accumulate; the caller scales each part).
        A non-finite loss (on any process) skips all of ``experts`` (gradients cleared,
        ``train/nan_skipped`` logged); a non-finite gradient norm skips that expert only (gradients are
        all-reduced, so every process agrees). No NaN ever reaches a weight. A loss whose autograd graph
        reaches a trainable expert not in ``experts`` (sharded or not) raises ``GradientLeakError`` before
        its backward, and so does a backward that wrote into one anyway (a reentrant checkpoint hides
        parameters from the graph): those gradients would silently join that expert's next step.
        """
        parts = [lambda: losses] if isinstance(losses, torch.Tensor) else list(losses)
        guard = self._grad_snapshot(experts)
        others = [name for name in self.card.trainable if name not in experts]
        for i, part in enumerate(parts):
            loss = part()
            leaked = sorted(self._experts_in_graph(loss, others)) if others else []
            if leaked:
                raise GradientLeakError(self._leak_message(experts, leaked, "would write"))
            # decided on all ranks together: one rank skipping its backward would leave DDP's others waiting
            if self.any_rank(not bool(torch.isfinite(loss.detach()).all())):
                self._skip_non_finite(loss, experts)
                return False
            self.backward_experts(loss, experts, last=i == len(parts) - 1)
        self._check_no_leak(guard, experts)
        for name in experts:
            self._nan_streak[name] = 0
            self._micro[name] = self._micro.get(name, 0) + 1
            if self._micro[name] % self.card.specs[name].accumulate == 0:
                self._step_one(name)
        return True

    def _skip_non_finite(self, loss: torch.Tensor, experts: list[str]) -> None:
        for name in experts:
            self._nan_streak[name] = self._nan_streak.get(name, 0) + 1
            self.optimizer_of(name).zero_grad(set_to_none=True)
            self.log(f"train/nan_skipped/{name}", 1.0, on_step=True)
        streak = max(self._nan_streak[name] for name in experts)
        rank_zero_warn(f"iteration {self.global_step}: loss of {experts} is {loss.item()}; step skipped "
                       f"({streak}/{self.run.max_nan_steps} in a row)")
        if streak >= self.run.max_nan_steps:
            raise NonFiniteLossError(
                f"the loss of {experts} was not finite for {streak} iterations in a row "
                f"(run.max_nan_steps={self.run.max_nan_steps}); no NaN was written to the weights. Lower the "
                f"learning rate, check the data and rewards, or raise model.init_args.run.max_nan_steps.")

    def _grad_snapshot(self, experts: list[str]) -> list[tuple[str, torch.nn.Parameter, Optional[int]]]:
        """(expert, parameter, gradient version or None) of every plain trainable expert not in ``experts``."""
        others = [n for n in self.plain_trainable if n not in experts]
        return [(n, p, None if p.grad is None else p.grad._version) for n in others
                for p in self.card.parameters_of(n)]

    def _experts_in_graph(self, loss: torch.Tensor, among: list[str]) -> set[str]:
        """The experts of ``among`` whose parameters ``loss``'s autograd graph reaches (its AccumulateGrad leaves).
        The caller skips the walk when no trainable expert is outside the step: nothing could leak."""
        owner = {id(p): name for name in among for p in self.card.parameters_of(name)}
        found, seen, stack = set(), set(), [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)
            if variable is not None and id(variable) in owner:
                found.add(owner[id(variable)])
            stack.extend(next_node for next_node, _ in node.next_functions)
        return found

    def _check_no_leak(self, snapshot, experts: list[str]) -> None:
        leaked = sorted({n for n, p, version in snapshot
                         if (p.grad is not None) and (version is None or p.grad._version != version)})
        if leaked:
            raise GradientLeakError(self._leak_message(experts, leaked, "wrote"))

    @staticmethod
    def _leak_message(experts: list[str], leaked: list[str], verb: str) -> str:
        return (f"a backward meant for {experts} {verb} gradients into {leaked}: their forward ran with grad "
                f"inside this loss. Run it under `torch.no_grad()` (or detach its output), or step those "
                f"experts from this loss too.")

    def _step_one(self, name: str) -> None:
        spec = self.card.specs[name]
        strategy = self.trainer.strategy
        if hasattr(strategy, "expert_step") and strategy.expert_step(self, name):
            self.stepped.add(name)
            return
        optimizer = self.optimizer_of(name)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if spec.accumulate > 1:
            for p in params:
                p.grad.div_(spec.accumulate)
        max_norm = spec.grad_clip if spec.grad_clip is not None else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.zeros(())
        self.log(f"train/grad_norm/{name}", norm, on_step=True)
        if not torch.isfinite(norm):
            optimizer.zero_grad(set_to_none=True)
            self.log(f"train/nan_skipped/{name}", 1.0, on_step=True)
            rank_zero_warn(f"iteration {self.global_step}: gradient norm of {name!r} is {norm.item()}; step skipped")
            return
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler = self.scheduler_of(name)
        if scheduler is not None:
            scheduler.step()
        self.log(f"train/lr/{name}", optimizer.param_groups[0]["lr"], on_step=True)
        self.stepped.add(name)

    # ------------------------------------------------------------------ serving
    def keep_serving_ema(self, decay: Optional[float]) -> None:
        """With ``decay`` set (a method's ``ema_decay``), add ``<generator>_ema``, an EMA of the trained generator
        blended after each of its steps with this decay, which then serves (``serving_transformer``): sample
        videos, validation, ``predict``. Call from ``setup_roles``."""
        if decay is not None:  # a pair: each trained expert's EMA (``serving_transformer`` runs the pair's)
            self.add_policy_roles("ema", constant(decay))

    @property
    def serving_transformer(self) -> str:
        """The generator that serves samples: its EMA copy when the method keeps one (a pair: the EMA of either
        expert, which runs the pair with each expert's EMA where it has one: ``GeneratorStage.pair_of``)."""
        generators = self.stage.generators
        return next((name for name, (of, role) in self.card.roles.items() if of in generators and role == "ema"),
                    self.stage.transformer)

    def conditioning(self, prompts: list[str], sampler: FlowMatchSampler, images: Optional[torch.Tensor] = None,
                     latents: Optional[torch.Tensor] = None):
        """``prompts``' conditioning and, when ``sampler`` guides (CFG), the empty prompt's (cached like any
        prompt); an image-to-video generator also reads ``images`` (B, 3, H, W), the first frames of its videos, or
        reads them off the clips' clean ``latents`` (``first_frames``)."""
        return self.stage.conditioning(prompts, sampler.guidance_scale, self.device, images=images, size=self.video,
                                       latents=latents)

    @property
    def reads_first_frames(self) -> bool:
        """Whether each row of a batch brings the generator its first frame, which ``first_frames`` reads and
        ``generate`` takes: an image-to-video generator served on its own (a workflow's image stage makes them)."""
        return self.stage.takes_image

    def batch_images(self, batch: dict) -> Optional[torch.Tensor]:
        """The conditioning images of a batch for an image-to-video generator: its ``image`` (B, 3, H, W),
        else the first frames of its ``video``; None for a generator that reads no image."""
        if not self.reads_first_frames:
            return None
        if "image" in batch:
            return batch["image"].float()
        if "video" in batch:
            return batch["video"][:, :, 0].float()
        raise ValueError(f"{type(self.stage.adapter).__name__} ({self.stage.transformer!r}) generates from a first "
                         f"frame, but the batch holds only {sorted(batch)}: use a datamodule whose batches carry "
                         f"`image` or `video` (SyntheticVideos, VideoFolder), or a workflow with an image stage")

    def first_frames(self, batch: dict) -> dict[str, torch.Tensor]:
        """Where an image-to-video generator reads each row's first frame, as keywords of ``conditioning`` and
        ``generate``: ``{"images": ...}`` (``batch_images``), or, for a batch of precomputed ``latents`` without pixels
        (a ``latents_cache``, ``PrecomputedVideos``), ``{"latents": ...}``, which a generator whose image is the clip's
        first latent frame reads off them with its adapter's ``image_from_latents`` (Wan 2.2 TI2V: its VAE is causal
        in time, so the frame is the first pixel frame's latents alone; any other generator refuses them, naming
        why). ``{}`` for a generator that reads no image."""
        if not self.reads_first_frames:
            return {}
        if "latents" in batch and "image" not in batch and "video" not in batch:
            return {"latents": batch["latents"].float()}
        return {"images": self.batch_images(batch)}

    def condition_batch(self, batch: dict, prompts: list[str], size: VideoSize) -> Conditioning:
        """``prompts``' conditioning for the rows of ``batch`` (``size`` videos): the text and, for an image-to-video
        generator, each row's first frame (``first_frames``)."""
        return self.stage.condition(prompts, self.device, size=size, **self.first_frames(batch))

    def batch_latents(self, batch: dict, reader: str, alternative: str = "") -> torch.Tensor:
        """(B, C, F', h, w) the batch's clean latents: its precomputed ``latents``, or the VAE's of its ``video``
        (the posterior mean). ``reader`` says who reads them and ``alternative`` a way round, for the error a batch
        of prompts alone gets."""
        if "latents" in batch:
            return batch["latents"].float()
        if "video" in batch:
            return self.stage.encode(batch["video"])
        raise ValueError(f"{reader}, but the data gives prompts only: use captioned videos as data (SyntheticVideos, "
                         f"VideoFolder, PrecomputedVideos){alternative}")

    @torch.no_grad()
    def generate(self, prompts: list[str], seed: int = 0, latents_only: bool = False,
                 images: Optional[torch.Tensor] = None, latents: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(B, C, F, H, W) videos in [-1, 1] for ``prompts`` (and, image-to-video, their first frames
        ``images``, or the clean clip ``latents`` they are read off: ``first_frames``): the sampler's loop over the
        serving transformer (chunk by chunk for a block-causal one), then VAE decoding. The noise is ``torch.randn``
        of one CPU rng seeded with ``seed``, in the latent shape (C, F', h, w) the diffusers pipeline draws, so
        ``WanPipeline(latents=that noise)`` reproduces it (``FluxPipeline`` takes it packed, ``Flux.pack(noise)``)."""
        shape = self.stage.latent_shape(self.video)
        rng = torch.Generator().manual_seed(seed)
        noise = torch.randn((len(prompts), *shape), generator=rng).to(self.device)
        cond, uncond = self.conditioning(prompts, self.sampler, images, latents)
        # the same rng draws any later noise (a few-step student's re-noise steps)
        traj = self.stage.sample(self.sampler, noise, cond, uncond, name=self.serving_transformer, rng=rng)
        return traj.latents if latents_only else self.stage.decode(traj.latents)

    def serving_settings(self) -> dict[str, Any]:
        """What export writes beside the weights so a diffusers pipeline serves as ``predict`` does: the
        scheduler (class and config), steps, guidance, text length, size, the serving transformer."""
        return stage_serving_settings(self.stage, self.sampler, self.video, self.serving_transformer)

    def predict_step(self, batch: dict, batch_idx: int) -> dict:
        prompts = list(batch["prompt"])
        return {"prompts": prompts, "videos": self.generate(prompts, seed=batch_schema.seed(batch, batch_idx),
                                                            **self.first_frames(batch)).cpu()}


def stage_serving_settings(stage: GeneratorStage, sampler: FlowMatchSampler, size: VideoSize,
                           transformer: str) -> dict[str, Any]:
    """The serving settings of one generator stage (export reads them): its sampler's scheduler, steps and
    guidance, the text length, the size, the component that serves (``transformer``) and the stage's experts."""
    scheduler = sampler.scheduler
    return {"scheduler": {"class": type(scheduler).__name__, "config": dict(scheduler.config)},
            "num_inference_steps": sampler.num_steps, "guidance_scale": sampler.guidance_scale,
            **({} if sampler.guidance_scale_2 is None else {"guidance_scale_2": sampler.guidance_scale_2}),
            "sigmas": sampler.step_sigmas, "chunk_frames": sampler.chunk_frames,
            "max_sequence_length": stage.card.text_max_length, "num_frames": size.frames,
            "height": size.height, "width": size.width, "transformer": transformer,
            "generator": stage.transformer, "vae": stage.vae, "text_encoders": list(stage.encoders),
            "image_encoder": stage.image_encoder, "embedded_guidance": stage.embedded_guidance,
            **({} if stage.transformer_2 is None else {"transformer_2": stage.pair_of(transformer)[1],
                                                       "boundary_ratio": stage.card.boundary_ratio})}
