"""The thin base every method stands on: one optimizer per trainable expert, stepped by hand.

It owns plumbing only — never a method's algorithm:
- ``configure_optimizers``: one optimizer (and optional scheduler) per trainable expert of the card;
- ``step_experts(loss, experts)``: one backward, then per expert accumulation, gradient clipping,
  a non-finite guard and the optimizer step, logging ``train/grad_norm/<expert>``, ``train/lr/<expert>``;
- iterations: Lightning counts every ``optimizer.step()`` in ``global_step``; here optimizers are
  stepped raw and ``callbacks.IterationCounter`` advances ``global_step`` once per training batch, so
  ``max_steps``, logging and checkpoint cadence count iterations whatever the number of experts;
- exact resume: the method's noise generator, the global RNGs, accumulation counters and the card's
  signature travel in the checkpoint; a checkpoint of another card is refused before anything loads;
- ``generate``: the serving path (same sampler as every rollout), used by ``predict`` and sample logging.
"""
from __future__ import annotations

import contextlib
import math
import random
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_warn

from posttrain.callbacks.iterations import IterationCounter
from posttrain.callbacks.versions import SyncPlan, WeightVersions
from posttrain.modules import vae as vae_codec
from posttrain.modules.cards import ModelCard
from posttrain.modules.samplers import FlowMatchSampler, wan_velocity


class NonFiniteLossError(RuntimeError):
    pass


class ExpertModule(LightningModule):
    """Base of every method. Subclasses write ``training_step`` as their algorithm.

    Args:
        card: the experts.
        sampler: the serving sampler (``predict``, sample logging); rollouts use it with ``sde=True``.
        seed: seed of the method's own noise generator (offset by the process rank).
        max_nan_steps: stop after this many iterations in a row whose loss was not finite.
        frames, height, width: size of generated videos (pixels).
    """

    def __init__(self, card: ModelCard, sampler: Optional[FlowMatchSampler] = None, seed: int = 0,
                 max_nan_steps: int = 3, frames: int = 9, height: int = 32, width: int = 32):
        super().__init__()
        self.automatic_optimization = False
        self.card = card
        self.sampler = sampler or FlowMatchSampler()
        self.seed = seed
        self.max_nan_steps = max_nan_steps
        self.frames, self.height, self.width = frames, height, width
        self.sync_plans: list[SyncPlan] = []
        self.stepped: set[str] = set()  # experts whose optimizer stepped in this iteration
        self._micro: dict[str, int] = {}
        self._nan_streak: dict[str, int] = {}  # expert -> iterations in a row with a non-finite loss
        self._deferred_logs: dict[str, tuple] = {}  # name -> (hook, value, kwargs) of a deferred self.log
        self.generator = torch.Generator().manual_seed(seed)

    @staticmethod
    def card_problems(card: ModelCard, method: str, trains: tuple[str, ...] = ("transformer",),
                      needs: tuple[str, ...] = ("text_encoder", "vae")) -> list[str]:
        """The card-shape problems of a method that trains ``trains`` and reads ``needs``."""
        problems = [f"the card has no {name!r}" for name in (*trains, *needs) if not card.has(name)]
        problems += [f"{method} trains `{name}`: set `trainable: true` and give it an optimizer"
                     for name in trains if card.has(name) and not card.specs[name].trainable]
        return problems

    # ------------------------------------------------------------------ setup
    def configure_model(self) -> None:
        if not self.card.built:
            # a sharding strategy builds its sharded experts under its own context (deepspeed.zero.Init)
            # and gathers them while roles copy them
            strategy = self._trainer.strategy if self._trainer is not None else None
            self.card.build(init_context=getattr(strategy, "expert_init_context", None))
            gathered = getattr(strategy, "gathered_experts", lambda card: contextlib.nullcontext())
            with gathered(self.card):
                self.setup_roles()

    def setup_roles(self) -> None:
        """Methods add frozen roles (``card.add_role``) and sync plans here, after the card is built."""

    def setup(self, stage: str) -> None:
        sharded = [name for name, spec in self.card.specs.items() if spec.sharded]
        if sharded and not hasattr(self.trainer.strategy, "expert_backward"):
            raise ValueError(
                f"experts {sharded} have `sharded: true`, but trainer.strategy is "
                f"{type(self.trainer.strategy).__name__}, which does not shard: set `trainer.strategy: "
                f"{{class_path: posttrain.lit.strategy.ShardedExpertsStrategy}}`, or `sharded: false` on those experts")
        # each expert's backward leaves the other experts' parameters without gradient: DDP must expect that
        plain = [name for name in self.card.trainable if not self.card.specs[name].sharded]
        strategy = self.trainer.strategy
        if isinstance(strategy, DDPStrategy) and strategy.world_size > 1 and len(plain) > 1 \
                and not strategy._ddp_kwargs.get("find_unused_parameters", False):
            raise ValueError(
                f"experts {plain} train under DDP with separate backward passes, which needs "
                f"find_unused_parameters: set `trainer.strategy: ddp_find_unused_parameters_true`, or "
                f"`{{class_path: posttrain.lit.strategy.ShardedExpertsStrategy}}` (it sets it)")
        self.generator = torch.Generator().manual_seed(self.seed + self.global_rank)

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

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
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
            optimizer = spec.optimizer(self.card.parameters_of(name))
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

    def backward_experts(self, loss: torch.Tensor, experts: list[str]) -> None:
        """One backward for ``experts``; a sharded strategy routes it through their DeepSpeed engines."""
        strategy = self.trainer.strategy
        if hasattr(strategy, "expert_backward"):
            strategy.expert_backward(self, loss, experts)
        else:
            self.manual_backward(loss)

    def step_experts(self, loss: torch.Tensor, experts: list[str]) -> bool:
        """Backward ``loss`` once and step every expert in ``experts`` that is due; False if skipped.

        A non-finite loss (on any process) skips all of them (no backward, gradients cleared,
        ``train/nan_skipped`` logged); a non-finite gradient norm skips that expert only (gradients are
        all-reduced, so every process agrees). No NaN ever reaches a weight.
        """
        # decided on all ranks together: one rank skipping its backward would leave DDP's others waiting
        if self.any_rank(not bool(torch.isfinite(loss.detach()).all())):
            for name in experts:
                self._nan_streak[name] = self._nan_streak.get(name, 0) + 1
                self.optimizer_of(name).zero_grad(set_to_none=True)
                self.log(f"train/nan_skipped/{name}", 1.0, on_step=True)
            streak = max(self._nan_streak[name] for name in experts)
            rank_zero_warn(f"iteration {self.global_step}: loss of {experts} is {loss.item()}; step skipped "
                           f"({streak}/{self.max_nan_steps} in a row)")
            if streak >= self.max_nan_steps:
                raise NonFiniteLossError(
                    f"the loss of {experts} was not finite for {streak} iterations in a row "
                    f"(max_nan_steps={self.max_nan_steps}); no NaN was written to the weights. Lower the "
                    f"learning rate, check the data and rewards, or raise model.init_args.max_nan_steps.")
            return False
        for name in experts:
            self._nan_streak[name] = 0
        self.backward_experts(loss, experts)
        for name in experts:
            self._micro[name] = self._micro.get(name, 0) + 1
            if self._micro[name] % self.card.specs[name].accumulate == 0:
                self._step_one(name)
        return True

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
        return "transformer_ema" if "transformer_ema" in self.card.models else "transformer"

    def conditioning(self, prompts: list[str],
                     guidance_scale: float) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(B, L, D) prompt embeddings and, when CFG is on, the empty prompt's (cached like any prompt)."""
        cond = self.card.prompt_embeds(prompts).to(self.device)
        if guidance_scale == 1.0:
            return cond, None
        return cond, self.card.prompt_embeds([""] * len(prompts)).to(self.device)

    @torch.no_grad()
    def generate(self, prompts: list[str], seed: int = 0, latents_only: bool = False) -> torch.Tensor:
        """(B, C, F, H, W) videos in [-1, 1] for ``prompts``: ODE sampling, then VAE decoding."""
        shape = vae_codec.latent_shape(self.card["vae"], self.frames, self.height, self.width)
        generator = torch.Generator().manual_seed(seed)
        noise = torch.randn((len(prompts), *shape), generator=generator).to(self.device)
        cond, uncond = self.conditioning(prompts, self.sampler.guidance_scale)
        with self.card.use(self.serving_transformer) as transformer:
            traj = self.sampler.sample(wan_velocity(transformer), noise, cond, uncond)
        if latents_only:
            return traj.latents
        return vae_codec.decode(self.card["vae"], traj.latents)

    def predict_step(self, batch: dict, batch_idx: int) -> dict:
        seeds = batch.get("seed")
        seed = int(seeds[0]) if seeds is not None else batch_idx
        return {"prompts": list(batch["prompt"]), "videos": self.generate(list(batch["prompt"]), seed=seed).cpu()}

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        generators = [self.generator.get_state()]
        if dist.is_available() and dist.is_initialized():
            generators = [None] * dist.get_world_size()
            dist.all_gather_object(generators, self.generator.get_state())
        checkpoint["posttrain"] = {
            "signature": self.card.signature(),
            "configs": {name: model_config(model) for name, model in self.card.models.items()},
            "arch": {name: spec.arch for name, spec in self.card.specs.items()},
            "generators": generators,
            "micro": dict(self._micro),
            "nan_streak": dict(self._nan_streak),
            "rng": {"torch": torch.get_rng_state(), "numpy": _numpy_state(), "python": random.getstate()},
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("posttrain")
        if state is None:
            raise ValueError("this checkpoint was not written by posttrain (no 'posttrain' entry); "
                             "load plain weights with `pretrained:` on the expert instead")
        check_signature(state["signature"], self.card.signature())
        generators = state["generators"]
        self.generator.set_state(generators[self.global_rank % len(generators)])
        self._micro = dict(state["micro"])
        self._nan_streak = dict(state["nan_streak"])
        torch.set_rng_state(state["rng"]["torch"])
        _set_numpy_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])


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
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


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
