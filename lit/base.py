"""The thin base every method stands on: one optimizer per trainable expert, stepped by hand.

It owns plumbing only — never a method's algorithm:
- ``configure_optimizers``: one optimizer (and optional scheduler) per trainable expert of the card;
- ``step_experts(losses, experts)``: back the loss (or a list of per-step losses, one at a time) up into
  ``experts`` only — a loss whose graph reaches another trainable expert is refused before its backward —
  then per expert accumulation, gradient clipping, a non-finite guard and the optimizer step, logging
  ``train/grad_norm/<expert>``, ``train/lr/<expert>``;
- iterations: Lightning counts every ``optimizer.step()`` in ``global_step``; here optimizers are
  stepped raw and ``callbacks.IterationCounter`` advances ``global_step`` once per training batch, so
  ``max_steps``, logging and checkpoint cadence count iterations whatever the number of experts;
- exact resume: the method's noise generators (``generator``, one stream per process, and
  ``shared_generator``, the same stream on every process), the global RNGs, accumulation counters and the
  card's signature travel in the checkpoint; a checkpoint of another card is refused before anything loads;
- ``generate``: the serving path (the one sampler, through the generator stage), used by ``predict``,
  sample logging and evaluation.
"""
from __future__ import annotations

import contextlib
import math
import random
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning

from posttrain.callbacks.iterations import IterationCounter
from posttrain.callbacks.versions import WeightVersions
from posttrain.modules.versions import SyncPlan
from posttrain.lit.engine.checkpoint_io import install_checkpoint_io
from posttrain.modules import batch as batch_schema
from posttrain.modules import presets
from posttrain.modules.cards import ModelCard
from posttrain.modules.generators import GeneratorStage, VideoSize
from posttrain.modules.samplers import FlowMatchSampler

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
        seed: seed of the method's own noise generator (offset by the process rank).
        max_nan_steps: stop after this many iterations in a row whose loss was not finite.
        embedded_guidance: the guidance value a guidance-distilled generator embeds (FLUX-dev;
            FluxPipeline's ``guidance_scale``); None = the generator adapter's default; generators without a
            guidance embedding ignore it.
    """

    frames: int = 9
    height: int = 32
    width: int = 32
    seed: int = 0
    max_nan_steps: int = 3
    embedded_guidance: Optional[float] = None

    @property
    def video(self) -> VideoSize:
        return VideoSize(self.frames, self.height, self.width)


class ExpertModule(LightningModule):
    """Base of every method. Subclasses write ``training_step`` as their algorithm.

    Args:
        card: the experts.
        sampler: the serving sampler (``predict``, sample logging); rollouts use it with ``sde=True``.
        run: size of generated videos, seed, NaN tolerance.
    """

    def __init__(self, card: ModelCard, sampler: Optional[FlowMatchSampler] = None, run: Optional[RunArgs] = None):
        super().__init__()
        self.automatic_optimization = False
        self.card = card
        self.sampler = sampler or FlowMatchSampler()
        self.run = run or RunArgs()
        # the card's generator: transformer + vae + its text encoders (+ an image encoder), through its adapter
        self.stage = GeneratorStage(card, embedded_guidance=self.run.embedded_guidance)
        self.sync_plans: list[SyncPlan] = []
        self.stepped: set[str] = set()  # experts whose optimizer stepped in this iteration
        self._micro: dict[str, int] = {}
        self._nan_streak: dict[str, int] = {}  # expert -> iterations in a row with a non-finite loss
        self._frozen_digests: dict[str, str] = {}  # frozen expert -> SHA-256 of its weights (computed once)
        self._deferred_logs: dict[str, tuple] = {}  # name -> (hook, value, kwargs) of a deferred self.log
        self.generator = torch.Generator().manual_seed(self.run.seed)
        # draws every process must agree on (e.g. Self-Forcing's exit step): seeded alike on all ranks
        self.shared_generator = torch.Generator().manual_seed(self.run.seed)

    @property
    def video(self) -> VideoSize:
        return self.run.video

    def card_problems(self, method: str, trains: tuple[str, ...] = ("transformer",)) -> list[str]:
        """The card-shape problems of a method that trains ``trains`` with the card's generator stage."""
        problems = [p for p in self.stage.problems()]
        problems += [f"the card has no {name!r}" for name in trains if not self.card.has(name)
                     and f"the card has no {name!r}" not in problems]
        problems += [f"{method} trains `{name}`: set `trainable: true` and give it an optimizer"
                     for name in trains if name in self.card.specs and not self.card.specs[name].trainable]
        generator = self.card.specs.get(self.stage.transformer)
        if self.sampler.chunk_frames is not None and generator is not None \
                and not presets.causal(generator.arch):
            problems.append(f"sampler.chunk_frames={self.sampler.chunk_frames} samples chunk by chunk with a KV "
                            f"cache, but `{self.stage.transformer}` has arch {generator.arch!r}, which is not "
                            f"block-causal: set `arch: wan_t2v_causal`, or sampler.chunk_frames: null")
        if self.run.max_nan_steps < 1:
            problems.append(f"run.max_nan_steps={self.run.max_nan_steps} must be >= 1")
        return problems

    # ------------------------------------------------------------------ setup
    def configure_model(self) -> None:
        if not self.card.built:
            # a sharding strategy builds its sharded experts itself (partitioned under deepspeed.zero.Init)
            # and gathers them while roles copy them
            strategy = self._trainer.strategy if self._trainer is not None else None
            self.card.build(build_expert=getattr(strategy, "build_expert", None))
            gathered = getattr(strategy, "gathered_experts", lambda card: contextlib.nullcontext())
            with gathered(self.card):
                self.setup_roles()
        self.check_sizes()

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
        if getattr(self.trainer.precision_plugin, "scaler", None) is not None:  # float16 AMP (GPU)
            raise ValueError(
                f"trainer.precision={self.trainer.precision}: float16 mixed precision needs a gradient scaler per "
                f"expert, and experts are stepped by hand here without one; use `precision: bf16-mixed` (no scaler "
                f"needed) or `dtype: bfloat16` on the experts")
        sharded = [name for name, spec in self.card.specs.items() if spec.sharded]
        if sharded and not hasattr(self.trainer.strategy, "expert_backward"):
            raise ValueError(
                f"experts {sharded} have `sharded: true`, but trainer.strategy is "
                f"{type(self.trainer.strategy).__name__}, which does not shard: set `trainer.strategy: "
                f"{{class_path: posttrain.lit.engine.strategy.ShardedExpertsStrategy}}`, or `sharded: false` on those experts")
        # each expert's backward leaves the other experts' parameters without gradient: DDP must expect that
        plain = [name for name in self.card.trainable if not self.card.specs[name].sharded]
        strategy = self.trainer.strategy
        if isinstance(strategy, DDPStrategy) and strategy.world_size > 1 and len(plain) > 1 \
                and not strategy._ddp_kwargs.get("find_unused_parameters", False):
            raise ValueError(
                f"experts {plain} train under DDP with separate backward passes, which needs "
                f"find_unused_parameters: set `trainer.strategy: ddp_find_unused_parameters_true`, or "
                f"`{{class_path: posttrain.lit.engine.strategy.ShardedExpertsStrategy}}` (it sets it)")
        self.generator = torch.Generator().manual_seed(self.run.seed + self.global_rank)
        self.shared_generator = torch.Generator().manual_seed(self.run.seed)
        install_checkpoint_io(self.trainer.strategy)  # verified checkpoint folders, weights only

    def any_rank(self, flag: bool) -> bool:
        """``flag`` on any process. Under DDP every rank must run the same backward passes, so methods
        decide together whether an expert updates."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return flag
        t = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    # training hooks whose self.log defaults to on_step=True, on_epoch=False
    _STEP_HOOKS = ("training_step", "on_train_batch_start", "on_train_batch_end")

    def log(self, name: str, value: Any, prog_bar: bool = False, logger: Optional[bool] = None,
            on_step: Optional[bool] = None, on_epoch: Optional[bool] = None, **kwargs: Any) -> None:
        """``LightningModule.log``, deferred for a per-iteration training metric in an iteration whose metrics
        reach no logger.

        Lightning hands the loggers, every ``trainer.log_every_n_steps`` iterations, the latest value of each
        on-step metric, but each ``log`` call costs its bookkeeping (about 0.3 ms on a CPU: eight calls were
        15% of a tiny finetune iteration, bench/overhead.py). Here such a call only keeps the latest value;
        the next iteration whose metrics reach the loggers (or the run's last) logs what was kept, so loggers
        get the same values as before. ``trainer.callback_metrics`` and the progress bar refresh at the
        logging cadence. Epoch-aggregated metrics (``on_epoch=True``) and every other hook log at once.
        """
        kwargs.update(prog_bar=prog_bar, logger=logger, on_step=on_step, on_epoch=on_epoch)
        fx = self._current_fx_name
        if on_epoch or fx not in self._STEP_HOOKS or self.log_due:
            self._deferred_logs.pop(name, None)
            super().log(name, value, **kwargs)
        else:
            self._deferred_logs[name] = (fx, value.detach() if isinstance(value, torch.Tensor) else value, kwargs)

    def _flush_deferred_logs(self, batch_idx: int) -> None:
        # after every callback's on_train_batch_end, before Lightning hands metrics to the loggers; also at an
        # epoch's last batch, where Lightning's callback_metrics took the latest values before its epoch reset
        if self._deferred_logs and (self.log_due or self.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
                                    or batch_idx + 1 >= self.trainer.num_training_batches):
            deferred, self._deferred_logs = self._deferred_logs, {}
            current = self._current_fx_name
            for name, (fx, value, kwargs) in deferred.items():
                self._current_fx_name = fx  # Lightning keys a result by the hook that logged it
                super().log(name, value, **kwargs)
            self._current_fx_name = current

    def on_train_epoch_start(self) -> None:
        self._deferred_logs.clear()  # none outlives its epoch (Lightning resets its results there)

    @property
    def log_due(self) -> bool:
        """Whether this training iteration's on-step metrics reach the loggers (Lightning's own decision:
        every ``log_every_n_steps``, or when stopping), or it is the run's last iteration."""
        trainer = self._trainer
        if trainer is None or not trainer.training:
            return True
        due = getattr(trainer._logger_connector, "should_update_logs", True)
        # Lightning's batch count (what should_update_logs uses): global_step moves within the iteration
        iteration = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step) + 1
        last_step = 0 < trainer.max_steps <= iteration
        last_epoch = 0 < (trainer.max_epochs or -1) <= trainer.current_epoch + 1 \
            and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        return due or last_step or last_epoch

    def configure_callbacks(self):
        return [IterationCounter(), WeightVersions()]

    @property
    def engine_experts(self) -> dict[str, Any]:
        """Experts whose optimizer lives in a DeepSpeed engine of the strategy (name -> engine)."""
        trainer = self._trainer
        return getattr(trainer.strategy, "engines", {}) if trainer is not None else {}

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
        return configs or None

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
        for i, part in enumerate(parts):
            loss = part()
            leaked = sorted(self._experts_in_graph(loss) - set(experts))
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

    def _experts_in_graph(self, loss: torch.Tensor) -> set[str]:
        """The trainable experts whose parameters ``loss``'s autograd graph reaches (its AccumulateGrad leaves)."""
        owner = {id(p): name for name in self.card.trainable for p in self.card.parameters_of(name)}
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
    @property
    def serving_transformer(self) -> str:
        """The generator that serves samples: its EMA copy when the method keeps one."""
        generator = self.stage.transformer
        return next((name for name, (of, role) in self.card.roles.items() if of == generator and role == "ema"),
                    generator)

    def conditioning(self, prompts: list[str], sampler: FlowMatchSampler, images: Optional[torch.Tensor] = None):
        """``prompts``' conditioning and, when ``sampler`` guides (CFG), the empty prompt's (cached like any
        prompt); an image-to-video generator also reads ``images`` (B, 3, H, W), the first frames of its videos."""
        return self.stage.conditioning(prompts, sampler.guidance_scale, self.device, images=images, size=self.video)

    def batch_images(self, batch: dict) -> Optional[torch.Tensor]:
        """The conditioning images of a batch for an image-to-video generator: its ``image`` (B, 3, H, W),
        else the first frames of its ``video``; None for a generator that reads no image."""
        if not self.stage.takes_image:
            return None
        if "image" in batch:
            return batch["image"].float()
        if "video" in batch:
            return batch["video"][:, :, 0].float()
        raise ValueError(f"{type(self.stage.adapter).__name__} ({self.stage.transformer!r}) generates from a first "
                         f"frame, but the batch holds only {sorted(batch)}: use a datamodule whose batches carry "
                         f"`image` or `video` (SyntheticVideos, VideoFolder), or a workflow with an image stage")

    @torch.no_grad()
    def generate(self, prompts: list[str], seed: int = 0, latents_only: bool = False,
                 images: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(B, C, F, H, W) videos in [-1, 1] for ``prompts`` (and, image-to-video, their first frames
        ``images``): the sampler's loop over the serving transformer (chunk by chunk for a block-causal one),
        then VAE decoding. The noise is ``torch.randn`` of one CPU rng seeded with ``seed``, in the
        latent shape (C, F', h, w) the diffusers pipeline draws, so ``WanPipeline(latents=that noise)``
        reproduces it (``FluxPipeline`` takes it packed, ``Flux.pack(noise)``)."""
        shape = self.stage.latent_shape(self.video)
        rng = torch.Generator().manual_seed(seed)
        noise = torch.randn((len(prompts), *shape), generator=rng).to(self.device)
        cond, uncond = self.conditioning(prompts, self.sampler, images)
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
                                                            images=self.batch_images(batch)).cpu()}

    # ------------------------------------------------------------------ only training draws from the global RNGs
    # Between two training batches Lightning may run a validation, or, in a resumed run, fast-forward over the one
    # the checkpoint was taken before (building the validation loader's iterator draws a seed from the global
    # torch RNG). Those draws would make a resumed run differ from an uninterrupted one, so the global RNG states
    # are taken when training starts and after every training batch, and put back before the next one (and at the
    # end of a validation epoch, before a checkpoint callback could save in ``on_validation_end``).
    def on_train_start(self) -> None:
        self._rng_between_batches = _collect_rng_states(include_cuda=torch.cuda.is_available())

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self._flush_deferred_logs(batch_idx)
        self._rng_between_batches = _collect_rng_states(include_cuda=torch.cuda.is_available())

    def on_train_batch_start(self, batch, batch_idx) -> None:
        states = getattr(self, "_rng_between_batches", None)
        if states is not None:
            _set_rng_states(states)
        self.take_precomputed(batch)

    def on_validation_batch_start(self, batch, batch_idx, dataloader_idx: int = 0) -> None:
        self.take_precomputed(batch)

    # ------------------------------------------------------------------ rows precomputed by `posttrain preprocess`
    def on_fit_start(self) -> None:
        self.check_precomputed()

    def on_validation_start(self) -> None:
        if self.trainer.state.fn == "validate":
            self.check_precomputed()

    def check_precomputed(self) -> None:
        """Refuse rows of a ``PrecomputedVideos`` datamodule made by other weights, size or text length, and
        cache its empty-prompt rows (caption dropout, CFG)."""
        data = getattr(self.trainer, "datamodule", None)
        manifest = getattr(data, "manifest", None)
        if manifest is None:
            return
        from posttrain.modules.precomputed import mismatches

        digests = {name: self.card.weights_digest(name) for name in manifest["sources"] if self.card.has(name)}
        video = (self.video.frames, self.video.height, self.video.width)
        problems = mismatches(manifest, digests, self.card.text_max_length, video)
        if problems:
            raise ValueError(f"the precomputed rows in {data.path!r} do not fit this run: {'; '.join(problems)}. "
                             f"Run `posttrain preprocess --config <this config> --out {data.path} --overwrite true` "
                             f"again, or train on the original data")
        for name, rows in data.empty_text_embeds.items():
            self.card.cache.put(name, self.card.versions[name], [""], rows.to(self._text_dtype(name)))

    def take_precomputed(self, batch) -> None:
        """A batch's precomputed text rows go into the card's cache, where the conditioning finds them."""
        rows = batch.get("text_embeds") if isinstance(batch, dict) else None
        for name, values in (rows or {}).items():
            self.card.cache.put(name, self.card.versions[name], list(batch["prompt"]),
                                values.to(self._text_dtype(name)))

    def _text_dtype(self, name: str) -> torch.dtype:
        return next(self.card[name].parameters()).dtype

    def on_validation_epoch_end(self) -> None:
        states = getattr(self, "_rng_between_batches", None)
        if states is not None and self.trainer.state.fn == "fit" and not self.trainer.sanity_checking:
            _set_rng_states(states)

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # frozen experts read from a file are not saved (the UMT5 of Wan 1.3B alone is ~23 GB in fp32): a resume
        # reloads them from their source and refuses a source that changed since
        frozen = {}
        for name in self.card.reloadable():
            prefix = f"card.models.{name}."
            keys = [k for k in checkpoint.get("state_dict", {}) if k.startswith(prefix)]
            if keys:
                for key in keys:
                    del checkpoint["state_dict"][key]
                if name not in self._frozen_digests:
                    self._frozen_digests[name] = self.card.weights_digest(name)
                frozen[name] = {"sha256": self._frozen_digests[name], "source": self.card.sources()[name]}
        generators = [self.generator.get_state()]
        if dist.is_available() and dist.is_initialized():
            generators = [None] * dist.get_world_size()
            dist.all_gather_object(generators, self.generator.get_state())
        checkpoint["posttrain"] = {
            "signature": self.card.signature(),
            "configs": {name: model_config(model) for name, model in self.card.models.items()},
            "arch": {name: spec.arch for name, spec in self.card.specs.items()},
            "sources": self.card.sources(),
            "serving": self.serving_settings(),
            "run": {"wandb_id": self._wandb_id()},
            "frozen": frozen,
            "generators": generators,
            "shared_generator": self.shared_generator.get_state(),
            "micro": dict(self._micro),
            "nan_streak": dict(self._nan_streak),
            "rng": {"torch": torch.get_rng_state(), "numpy": _numpy_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
        }

    def _wandb_id(self) -> Optional[str]:
        from lightning.pytorch.loggers import WandbLogger

        for logger in (self._trainer.loggers if self._trainer is not None else []):
            if isinstance(logger, WandbLogger):
                return str(logger.version)
        return None

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("posttrain")
        if state is None:
            raise ValueError("this checkpoint was not written by posttrain (no 'posttrain' entry); "
                             "load plain weights with `pretrained:` on the expert instead")
        check_signature(state["signature"], self.card.signature())
        self._restore_frozen(checkpoint, state.get("frozen") or {})
        generators = state["generators"]
        self.generator.set_state(generators[self.global_rank % len(generators)])
        if "shared_generator" in state:
            self.shared_generator.set_state(state["shared_generator"])
        self._micro = dict(state["micro"])
        self._nan_streak = dict(state["nan_streak"])
        torch.set_rng_state(state["rng"]["torch"])
        _set_numpy_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        if state["rng"].get("cuda") and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])


    def _restore_frozen(self, checkpoint: dict, frozen: dict) -> None:
        """Put back the frozen experts the checkpoint left out, from their sources, after checking that each
        source still holds the weights the checkpoint was trained with."""
        for name, saved in frozen.items():
            digest = self._frozen_digests.setdefault(name, self.card.weights_digest(name))
            if digest != saved["sha256"]:
                source = saved.get("source") or {}
                where = source.get("pretrained") or f"the shipped {source.get('arch')!r} weights"
                raise ValueError(f"frozen expert {name!r} is not the one this checkpoint was trained with: its source "
                                 f"({where}) changed since (weights SHA-256 {digest[:12]}… vs {saved['sha256'][:12]}…). "
                                 f"Restore that source, or start a new run from the checkpoint's trained experts")
            prefix = f"card.models.{name}."
            for key, value in self.card.models[name].state_dict().items():
                checkpoint["state_dict"][prefix + key] = value


def stage_serving_settings(stage: GeneratorStage, sampler: FlowMatchSampler, size: VideoSize,
                           transformer: str) -> dict[str, Any]:
    """The serving settings of one generator stage (export reads them): its sampler's scheduler, steps and
    guidance, the text length, the size, the component that serves (``transformer``) and the stage's experts."""
    scheduler = sampler.scheduler
    return {"scheduler": {"class": type(scheduler).__name__, "config": dict(scheduler.config)},
            "num_inference_steps": sampler.num_steps, "guidance_scale": sampler.guidance_scale,
            "sigmas": sampler.step_sigmas, "chunk_frames": sampler.chunk_frames,
            "max_sequence_length": stage.card.text_max_length, "num_frames": size.frames,
            "height": size.height, "width": size.width, "transformer": transformer,
            "generator": stage.transformer, "vae": stage.vae, "text_encoders": list(stage.encoders),
            "image_encoder": stage.image_encoder, "embedded_guidance": stage.embedded_guidance}


def _numpy_state() -> dict:
    """numpy's RNG state in types that ``torch.load(weights_only=True)`` accepts."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
            "gauss": float(gauss)}


def _set_numpy_state(state: dict) -> None:
    np.random.set_state(("MT19937", state["keys"].numpy().astype(np.uint32), state["pos"], state["has_gauss"],
                         state["gauss"]))


def model_config(model: torch.nn.Module) -> dict:
    """The constructor config of a diffusers or transformers model, as a plain dict."""
    model = getattr(model, "module", model) if type(model).__name__ == "DeepSpeedEngine" else model
    config = getattr(model, "config", None)
    if config is None:
        return {}
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    if "_use_default_values" in config:  # diffusers lists a set here: its order changes with the process
        config["_use_default_values"] = sorted(config["_use_default_values"])
    return config


def check_signature(saved: dict, current: dict) -> None:
    """Refuse a checkpoint whose experts differ from the card's, naming every difference."""
    problems = []
    for name in sorted(set(saved) | set(current)):
        if name not in current:
            problems.append(f"checkpoint has expert {name!r} ({saved[name]}), the card does not")
        elif name not in saved:
            problems.append(f"the card has expert {name!r} ({current[name]}), the checkpoint does not")
        elif saved[name] != current[name]:
            problems.append(f"expert {name!r} differs: checkpoint {saved[name]} vs card {current[name]}")
    if problems:
        raise ValueError("checkpoint does not match this model card; nothing was loaded:\n  - "
                         + "\n  - ".join(problems)
                         + "\nResume with the config the checkpoint was trained with, or start a new run.")
