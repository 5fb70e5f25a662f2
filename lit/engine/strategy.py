"""Shard only what is large: one DeepSpeed ZeRO engine per ``sharded`` expert, plain DDP for the rest.

Lightning's ``DeepSpeedStrategy`` wraps the whole LightningModule in one engine with one optimizer and
refuses the CPU. ``ShardedExpertsStrategy`` is a ``DDPStrategy`` that instead

- builds every expert with ``sharded: true`` and ZeRO stage 3 under ``deepspeed.zero.Init`` (each
  process only ever holds its shard), stored weights filled module by module, through ``card.build(build_expert=...)``;
- in ``configure_ddp`` gives each sharded expert its own ``deepspeed.initialize`` engine — its own
  optimizer and scheduler from the card, ZeRO stage 2/3, optional CPU offload, fp32/bf16, all from
  ``Expert.zero`` — kept here (``engines``); the card's model stays the model, and the card runs its forward
  through the engine (``card.route``: DeepSpeed's forward registers the backward hooks its optimizer needs);
- keeps every other parameter under DDP (the engines' parameters are listed in
  ``_ddp_params_and_buffers_to_ignore``; nothing is wrapped when no trainable parameter is left);
- routes ``ExpertModule.backward_experts`` / ``_step_one`` through the engines (``expert_backward``,
  ``expert_step``); engine steps never touch ``trainer.global_step`` (iterations are counted by
  ``callbacks.IterationCounter``);
- saves a checkpoint folder ``<name>.ckpt/`` through the one write sequence of ``modules/io/checkpoints.py``
  (temporary folder, every file hashed and fsynced, manifest, one rename), handing it the engines' shards:
  ``lightning.pt`` (the Lightning state of everything
  else: plain experts, their optimizers, loops, RNG, versions, data position), ``sharded.json`` and one
  ``engine.save_checkpoint`` folder per sharded expert, and resumes all of it with ``--ckpt_path`` after
  verifying every file, with DeepSpeed's own shard reads restricted to an allow-list of types.

``posttrain.modules.io.checkpoints.load(folder)`` turns such a folder back into an ordinary Lightning checkpoint dict
with full fp32 weights (``zero_to_fp32``); ``posttrain export``, ``predict`` and ``validate`` use it.
A checkpoint written at another world size resumes too: its shards are converted to DeepSpeed's universal
checkpoint (``ds_to_universal``, in this process, into a temporary folder), loaded at this size and verified against
the shards (``_load_resized``); shards a user converted by hand load with ``zero: {extra: {checkpoint:
{load_universal: true}}}``.

    trainer:
      strategy: {class_path: posttrain.lit.engine.strategy.ShardedExpertsStrategy}
      accelerator: cpu      # gloo; on GPUs the same YAML runs over NCCL
      devices: 2
"""
from __future__ import annotations

import contextlib
import copy
import io
import os
import shutil
from typing import Any, ContextManager, Mapping, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from posttrain.lit.engine.checkpoint_io import storage_extra, storage_meta
from posttrain.lit.engine.resume import check_signature
from posttrain.modules.io import checkpoints as ckpt
from posttrain.modules.models import presets
from posttrain.modules.models.cards import Expert, ModelCard, dtype_of
from posttrain.modules.models.sequence_parallel import enable_sequence_parallel, sequence_mesh

TAG, META = ckpt.ZERO_TAG, ckpt.SHARDED_META
UNIVERSAL = f"{TAG}_universal"  # DeepSpeed's universal checkpoint of a shard folder


class ShardedExpertsStrategy(DDPStrategy):
    """DDP for small experts, one DeepSpeed ZeRO engine for each expert marked ``sharded: true``.

    Takes ``DDPStrategy``'s arguments (``process_group_backend``, ``timeout``, ``find_unused_parameters``…);
    the ZeRO settings live on the experts of the card (``Expert.zero``). ``sequence_parallel``: k processes share one
    sample's tokens in every transformer of the card diffusers can split (Wan, FLUX) (``modules/models/sequence_parallel.py``); data parallelism is then
    over the world / k sequence groups (samples, noise streams).
    """

    strategy_name = "sharded_experts"

    def __init__(self, *args: Any, sequence_parallel: int = 1, **kwargs: Any):
        # a method backs up each expert's loss separately: the other experts' DDP parameters get no grad
        kwargs.setdefault("find_unused_parameters", True)
        super().__init__(*args, **kwargs)
        if sequence_parallel < 1:
            raise ValueError(f"sequence_parallel={sequence_parallel}: the processes that share one sample's tokens; "
                             f"give 1 (off) or a divisor of devices x num_nodes")
        self.sequence_parallel = sequence_parallel
        self.mesh = None  # (data, ring, ulysses) device mesh when sequence_parallel > 1
        self.sequence_experts: list[str] = []  # experts whose tokens the sequence groups share
        self.engines: dict[str, Any] = {}  # expert name -> deepspeed.DeepSpeedEngine

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # engines exist only after setup; they load their own shards

    # ------------------------------------------------------------------ setup
    def setup_environment(self) -> None:
        super().setup_environment()  # torch.distributed over gloo (CPU) or NCCL (CUDA)
        # DeepSpeed reads where this process is from the variables torchrun sets; under SLURM (or Lightning's own
        # launcher) Lightning knows it from its cluster environment
        for name, value in (("LOCAL_RANK", self.local_rank), ("RANK", self.global_rank),
                            ("WORLD_SIZE", self.world_size)):
            os.environ.setdefault(name, str(value))
        if self.root_device.type == "cpu":
            # DeepSpeed probes for an accelerator when imported and warns that it fell back to the CPU: say so instead
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        if self.root_device.type == "cpu":
            # DeepSpeed's shared-memory all-reduce serves CPU *inference* only; skipping it avoids a JIT build
            # of a C++ op at start-up (and the build lock a killed process leaves behind, which hangs the next)
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        # DeepSpeed reuses the process group Lightning made; no MPI discovery.
        deepspeed.init_distributed(dist_backend=self._get_process_group_backend(), auto_mpi_discovery=False,
                                   dist_init_required=False, verbose=False)
        card = self._card()
        if self.sequence_parallel > 1:
            self.mesh = sequence_mesh(self.sequence_parallel, self.root_device.type)
        elif not any(spec.sharded for spec in card.specs.values()):
            rank_zero_warn("ShardedExpertsStrategy: no expert has `sharded: true`; every expert runs under plain DDP")
        validate_zero_configs(card)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data parallelism is over sequence groups: the processes of one group draw the same samples."""
        return {"num_replicas": self.world_size // self.sequence_parallel,
                "rank": self.global_rank // self.sequence_parallel}

    @property
    def trained_engines(self) -> dict[str, Any]:
        """Engines that train and therefore checkpoint; a frozen ZeRO-3 expert is rebuilt from its source."""
        specs = self._card().specs
        return {name: engine for name, engine in self.engines.items() if specs[name].trainable}

    def _card(self) -> ModelCard:
        card = getattr(self.lightning_module, "card", None)
        if not isinstance(card, ModelCard):
            raise TypeError(f"ShardedExpertsStrategy needs an ExpertModule with a ModelCard `card`; got "
                            f"{type(self.lightning_module).__name__}")
        return card

    def build_expert(self, name: str, spec: Expert) -> Optional[torch.nn.Module]:
        """A ZeRO-3 expert while fitting, built under ``deepspeed.zero.Init``: each process allocates only its
        partition. Stored weights (``pretrained``, or a shipped asset) are not read by ``from_pretrained`` (which
        builds the whole model on every process first, and cannot fill ``zero.Init``'s partitions): the model
        is built from the folder's config, then filled from its safetensors one module at a time, each
        module's parameters gathered while rank 0 writes them. None for every other expert (built as usual)."""
        trainer = self.lightning_module._trainer
        if not spec.sharded or spec.zero.stage != 3 or trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return None
        import deepspeed

        init = deepspeed.zero.Init(config_dict_or_path=deepspeed_config(spec),
                                   remote_device="cpu" if spec.zero.offload_params else None)
        dtype = dtype_of(spec.dtype)
        if not presets.loads_weights(spec.arch, spec.pretrained, spec.preset):
            with init:
                return presets.build_model(spec.arch, None, None, spec.preset, dtype)
        with init:
            model = presets.build_skeleton(spec.arch, spec.pretrained, spec.subfolder, dtype)
        presets.load_weights(model, presets.weights_folder(spec.arch, spec.pretrained, spec.subfolder),
                             gather=lambda params: deepspeed.zero.GatheredParameters(params, modifier_rank=0),
                             reads=self.global_rank == 0)
        return model

    def gathered_experts(self, card: ModelCard) -> ContextManager:
        """Full weights of every ZeRO-3 expert on every process for the duration (role copies)."""
        params = [p for model in card.models.values() for p in model.parameters() if hasattr(p, "ds_id")]
        if not params:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

    def configure_ddp(self) -> None:
        import deepspeed

        module = self.lightning_module
        card = self._card()
        if self.mesh is not None:  # every transformer diffusers knows how to split (Wan, FLUX), roles included
            for name, model in card.models.items():
                if getattr(model, "_cp_plan", None) is not None:
                    enable_sequence_parallel(model, self.mesh)
                    self.sequence_experts.append(name)
            rank_zero_info(f"sequence parallel: groups of {self.sequence_parallel} processes share each sample's "
                           f"tokens in {self.sequence_experts}; {self.world_size // self.sequence_parallel} "
                           f"data-parallel rank(s)")
        for name, spec in card.specs.items():
            if not spec.sharded:
                continue
            model = card.models[name]
            params = card.parameters_of(name)
            optimizer = card.optimizer_for(name, params) if spec.trainable else None
            config = deepspeed_config(spec, model)
            try:
                engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=spec.scheduler,
                                                  model_parameters=params if spec.trainable else None,
                                                  config=config, dist_init_required=False)
            except Exception as err:  # DeepSpeed raises AssertionError/ValueError/pydantic errors
                raise ValueError(f"DeepSpeed rejected the ZeRO config of expert {name!r} ({spec.zero}): "
                                 f"{type(err).__name__}: {err}. Fix `zero:` of that expert.") from err
            card.route(name, engine)
            self.engines[name] = engine

        # DDP for the rest: the engines reduce their own gradients; what the module's list already holds (frozen
        # modules parked in host memory, ``offload_encoders``) stays out too
        prefixes = tuple(f"card.models.{name}." for name in self.engines)
        tensors = [*module.named_parameters(), *module.named_buffers()]
        ignore = list(dict.fromkeys([*getattr(module, "_ddp_params_and_buffers_to_ignore", []),
                                     *(n for n, _ in tensors if n.startswith(prefixes))]))
        module._ddp_params_and_buffers_to_ignore = ignore
        ignored = set(ignore)
        if any(p.requires_grad for n, p in module.named_parameters() if n not in ignored):
            super().configure_ddp()
        else:
            # nothing left to reduce: no DDP wrapper, but start every process from rank 0's weights as DDP would
            for n, tensor in tensors:
                if n not in ignored:
                    dist.broadcast(tensor.data, src=0)

    # ------------------------------------------------------------------ the base's hooks
    def expert_backward(self, module, loss: torch.Tensor, experts: list[str], last: bool = True) -> None:
        """One backward of ``loss``: through the engine of a sharded expert, else Lightning's. ``last``: the
        final backward of the iteration (several come when a method backs up per-step losses)."""
        sequence = [name for name in experts if name in self.sequence_experts]
        if sequence:
            if len(sequence) < len(experts):
                raise NotImplementedError(f"one loss backpropagated into sequence-parallel experts {sequence} and "
                                          f"others {sorted(set(experts) - set(sequence))}: give them separate losses")
            # each process of a sequence group backpropagates its own tokens of the same loss: the group's sum is
            # the gradient, and DDP / ZeRO average over every process, so k times the loss gives the data average
            loss = loss * self.sequence_parallel
        sharded = [name for name in experts if name in self.engines]
        if not sharded:
            module.manual_backward(loss)
            return
        if len(sharded) > 1:
            raise NotImplementedError(f"one loss backpropagated into two DeepSpeed engines {sharded}: give each "
                                      f"sharded expert its own loss (one `step_experts` call per sharded expert)")
        name = sharded[0]
        engine = self.engines[name]
        if len(sharded) < len(experts) and isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            from lightning.pytorch.overrides.distributed import prepare_for_backward

            prepare_for_backward(self.model, loss)  # the plain experts of this loss reduce through DDP
        # the base counts micro-batches; the engine steps (and reduces fully) on its accumulation boundary
        engine.set_gradient_accumulation_boundary(
            last and (module._micro.get(name, 0) + 1) % module.card.specs[name].accumulate == 0)
        engine.backward(loss)

    def expert_step(self, module, name: str) -> bool:
        """Step ``name``'s engine (ZeRO clipping, scheduler); False when the expert is not sharded."""
        engine = self.engines.get(name)
        if engine is None:
            return False
        engine.step()
        norm = engine.get_global_grad_norm()
        if norm is not None:
            module.log(f"train/grad_norm/{name}", float(norm), on_step=True)
        module.log(f"train/lr/{name}", float(engine.get_lr()[0]), on_step=True)
        return True

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The Lightning state without the sharded experts (their engines save them; under ZeRO-3 a plain
        ``state_dict`` would hold empty partitions)."""
        prefixes = tuple(f"card.models.{name}." for name in self.engines)
        return {k: v for k, v in super().lightning_module_state_dict().items() if not k.startswith(prefixes)}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        prefixes = tuple(f"card.models.{name}." for name in self.engines)
        missing, unexpected = self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=False)
        missing = [k for k in missing if not k.startswith(prefixes)]
        if strict and (missing or unexpected):
            raise RuntimeError(f"checkpoint state does not fit the model: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        """A checkpoint folder by the one write sequence (``ckpt.write_checkpoint``): ``lightning.pt``, ``sharded.json``
        and one ZeRO shard folder per trained engine, written into a temporary folder by every process and committed
        by rank 0 once every process has written, hashed and fsynced its part. Every process must call this."""
        if not self.trained_engines:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        meta = {name: sharded_meta(self._card().specs[name], self.world_size) for name in self.trained_engines}
        checkpoint["posttrain_sharded"] = meta
        # with every folder DeepSpeed would create: it writes nothing before its files
        shards = ckpt.Shards(_StrategyProcesses(self), write=self._save_engines,
                             folders=tuple(os.path.join(name, TAG) for name in self.trained_engines),
                             files={META: meta})
        ckpt.write_checkpoint(checkpoint, str(filepath), shards=shards,
                              meta={"world_size": self.world_size, **(storage_meta(storage_options) or {})},
                              extra=storage_extra(storage_options))

    def _save_engines(self, temp: str) -> None:
        """Every trained engine's ``save_checkpoint`` into ``temp``. A write that fails there (its files are written
        between DeepSpeed's collectives: two barriers and the tag check before, a barrier after) leaves the
        closing barrier, which the processes that wrote wait at: the failed one joins it, so that every process
        then reaches the same agreement (``ckpt.write_checkpoint``)."""
        failure: Optional[Exception] = None
        reloadable = self._card().reloadable()  # a LoRA expert's base, rebuilt from its source: left out
        for name, engine in self.trained_engines.items():
            try:
                engine.save_checkpoint(os.path.join(temp, name), tag=TAG,
                                       exclude_frozen_parameters=name in reloadable)
            except Exception as err:
                dist.barrier()
                failure = failure or err
        if failure is not None:
            raise failure

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            ckpt.remove_entry(str(filepath))

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = str(checkpoint_path)
        if not os.path.isdir(path):
            if self.trained_engines:
                raise ValueError(f"{path!r} is a single-file checkpoint, but experts {sorted(self.engines)} are "
                                 f"sharded: resume a folder checkpoint written by ShardedExpertsStrategy, or set "
                                 f"`sharded: false` to resume a plain DDP checkpoint")
            return super().load_checkpoint(checkpoint_path, weights_only)
        if not self.engines:  # validate / predict / test: full weights, no engines
            return ckpt.load(path)  # verified, ZeRO shards gathered into full weights
        checkpoint = ckpt.load(path, gather=False)  # every file verified (shards too); engines read their shards
        resized = self.check_resumable(checkpoint, path)
        with ckpt.restricted_unpickling(path):  # DeepSpeed's own torch.load calls: weights only, allow-listed types
            for name, engine in self.trained_engines.items():
                if name not in resized:
                    self._load_engine(engine, os.path.join(path, name), self._load_tag(name))
        if resized:
            self._load_resized(path, checkpoint, resized)
        return checkpoint

    def _load_engine(self, engine, folder: str, tag: str, universal: bool = False) -> None:
        """``engine.load_checkpoint`` of its shards (weights, optimizer, scheduler) in ``folder/tag``; ``universal``:
        a universal checkpoint, whatever the engine's config says. The module's weights: every key but the base a
        checkpoint saved with ``exclude_frozen_parameters`` leaves out (a LoRA base, which the module was built with
        from its source, digest-checked by ``lit/engine/resume.py``); anything else missing is refused."""
        configured = engine._config.load_universal_checkpoint  # DeepSpeed reads it when it loads, not before
        engine._config.load_universal_checkpoint = configured or universal
        try:
            load_path, _ = engine.load_checkpoint(
                folder, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True,
                custom_load_fn=lambda src, dst: presets.load_onto_base(dst, src))
        finally:
            engine._config.load_universal_checkpoint = configured
        if load_path is None:
            raise FileNotFoundError(f"no ZeRO checkpoint under {os.path.join(folder, tag)!r}")

    def _load_resized(self, path: str, checkpoint: dict, names: list[str]) -> None:
        """Resume the engines of ``names``, whose shards were written at another world size: rank 0 converts them
        to DeepSpeed's universal checkpoint (``ckpt.to_universal``) in a temporary folder beside the checkpoint (the
        checkpoint itself stays as written, and a kill leaves only a ``.tmp-`` folder the next save removes), every
        process loads its new partition from there, the weights that arrived are checked against the shards'
        (``verify_resized``), and the temporary folder goes."""
        saved = checkpoint["posttrain_sharded"]
        was = saved[names[0]]["world_size"]
        where = os.path.realpath(path)
        temp = ckpt.temp_path(where + ".universal", self.broadcast(ckpt.new_token() if self.is_global_zero else None))
        failure = None
        if self.is_global_zero:
            try:
                for name in names:
                    ckpt.to_universal(os.path.join(path, name, TAG), os.path.join(temp, name, UNIVERSAL),
                                      saved[name]["stage"])
            except Exception as err:  # a full disk, a shard DeepSpeed cannot convert
                failure = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        failure = self.broadcast(failure)
        try:
            if failure is not None:
                raise ckpt.CheckpointError(
                    f"checkpoint {path!r} was written by {was} processes, this run has {self.world_size}: converting "
                    f"the ZeRO shards of {names} to DeepSpeed's universal checkpoint (in {temp!r}) failed: {failure}. "
                    f"Nothing was loaded; resume with devices*num_nodes = {was}, or free space beside the checkpoint")
            with ckpt.restricted_unpickling(temp):
                for name in names:
                    self._load_engine(self.engines[name], os.path.join(temp, name), UNIVERSAL, universal=True)
            self.verify_resized(path, names)
        finally:
            self.barrier("resized_checkpoint_loaded")
            if self.is_global_zero:
                shutil.rmtree(temp, ignore_errors=True)
        rank_zero_info(f"resumed {path}, written by {was} processes, on {self.world_size}: the ZeRO shards of {names} "
                       f"were converted to DeepSpeed's universal checkpoint, resharded, and their weights verified")

    def verify_resized(self, path: str, names: list[str]) -> None:
        """Every parameter of the engines of ``names`` equals (in its dtype) the full weights rebuilt from the
        checkpoint's shards by ``zero_to_fp32`` (an independent reading of them), checked on rank 0 one gathered
        parameter at a time; a difference stops the run before training, naming the parameters."""
        import deepspeed

        differ: list[str] = []
        reloadable = set(self._card().reloadable())  # the same on every process: each skips the same parameters
        for name in names:
            with contextlib.redirect_stdout(io.StringIO()):  # zero_to_fp32 prints its progress
                reference = ckpt.full_weights(os.path.join(path, name)) if self.is_global_zero else {}
            for key, param in self._card().models[name].named_parameters():
                if not param.requires_grad and name in reloadable:  # a LoRA base: the source's, not in the shards
                    continue
                gathered = deepspeed.zero.GatheredParameters([param]) if hasattr(param, "ds_id") \
                    else contextlib.nullcontext()
                with gathered:
                    if self.is_global_zero and (key not in reference or not torch.equal(
                            param.detach().cpu(), reference[key].to(param.dtype))):
                        differ.append(f"{name}.{key}")
        differ = self.broadcast(differ)
        if differ:
            raise ckpt.CheckpointError(
                f"checkpoint {path!r}: after resharding to {self.world_size} processes, {len(differ)} parameter(s) "
                f"differ from the checkpoint's shards (e.g. {differ[:3]}); nothing was trained. Resume with the "
                f"world size the checkpoint was written at")

    def _load_tag(self, name: str) -> str:
        universal = self._card().specs[name].zero.extra.get("checkpoint", {}).get("load_universal", False)
        return UNIVERSAL if universal else TAG

    def check_resumable(self, checkpoint: dict, path: str) -> list[str]:
        """Refuse, before anything loads, a checkpoint of other experts or other ZeRO stages; returns the experts
        whose shards were written at another world size (``_load_resized`` reshards them)."""
        card = self._card()
        if "posttrain" in checkpoint:
            check_signature(checkpoint["posttrain"]["signature"], card.signature())
        saved: dict = checkpoint.get("posttrain_sharded", {})
        problems, resize = [], []
        for name in sorted(set(saved) | set(self.trained_engines)):
            if name not in self.trained_engines:
                problems.append(f"expert {name!r} is sharded in the checkpoint but not in this run")
            elif name not in saved:
                problems.append(f"expert {name!r} is sharded in this run but not in the checkpoint")
            else:
                now = sharded_meta(card.specs[name], self.world_size)
                if saved[name]["stage"] != now["stage"]:
                    problems.append(f"expert {name!r}: checkpoint has ZeRO stage {saved[name]['stage']}, this run "
                                    f"{now['stage']}; set `zero: {{stage: {saved[name]['stage']}}}` to resume")
                if saved[name]["world_size"] != now["world_size"] and self._load_tag(name) == TAG:
                    resize.append(name)
        if problems:
            raise ValueError(f"checkpoint {path!r} does not match this run's sharding; nothing was loaded:\n  - "
                             + "\n  - ".join(problems))
        return resize


# ---------------------------------------------------------------------- DeepSpeed configs
class _StrategyProcesses(ckpt.Processes):
    """The strategy's processes as a checkpoint write needs them (``ckpt.write_checkpoint``)."""

    def __init__(self, strategy: ShardedExpertsStrategy):
        self.strategy, self.rank, self.size = strategy, strategy.global_rank, strategy.world_size

    def broadcast(self, value: Any) -> Any:
        return self.strategy.broadcast(value)

    def barrier(self) -> None:
        self.strategy.barrier("sharded_checkpoint_dir")

    def all_gather(self, value: Any) -> list:
        gathered: list = [None] * self.size
        dist.all_gather_object(gathered, value)
        return gathered


def deepspeed_config(spec: Expert, model: Optional[torch.nn.Module] = None) -> dict[str, Any]:
    """The DeepSpeed config of one sharded expert, from ``Expert.zero`` (``extra`` merged last).

    With the built ``model``, buckets, ZeRO-3's live-parameter limits and sub-groups are sized to it (an
    eighth of its parameters, at least its largest tensor, at most DeepSpeed's default). Its defaults are
    made for billions of parameters: a 5e8-element gradient bucket (2 GB in fp32) whatever the model, and
    ZeRO-3 keeping up to 1e9 gathered parameters alive between forward and backward — for a smaller
    expert that is all of it, and ZeRO-3 would then use more memory than DDP.
    """
    zero = spec.zero
    zero_optimization: dict[str, Any] = {"stage": zero.stage}
    if model is not None:
        sizes = [getattr(p, "ds_numel", p.numel()) for p in model.parameters()]
        bucket = int(min(5e8, max(max(sizes), sum(sizes) // 8)))
        zero_optimization.update(reduce_bucket_size=bucket, allgather_bucket_size=bucket)
        if zero.stage == 3:
            # sub_group_size: the optimizer steps the partition in sub-groups, with one fp32 gradient buffer
            # of the largest sub-group (the default, 1e9, makes it a second copy of the gradient partition)
            zero_optimization.update(stage3_prefetch_bucket_size=bucket, stage3_max_live_parameters=bucket,
                                     stage3_max_reuse_distance=bucket, sub_group_size=bucket)
    if zero.offload_optimizer:
        zero_optimization["offload_optimizer"] = {"device": "cpu"}
    if zero.offload_params:
        zero_optimization["offload_param"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": 1,  # unused: the method feeds batches, DeepSpeed never sees them
        "gradient_accumulation_steps": spec.accumulate,
        "gradient_clipping": float(spec.grad_clip) if spec.grad_clip is not None else 0.0,
        "zero_optimization": zero_optimization,
        "bf16": {"enabled": zero.precision == "bf16"},
        "zero_allow_untested_optimizer": True,  # the card's own torch optimizer, as under DDP
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    return _merge(config, copy.deepcopy(zero.extra))


def _merge(base: dict, extra: dict) -> dict:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


def validate_zero_configs(card: ModelCard) -> None:
    """Every sharded expert's ZeRO config checked by DeepSpeed itself, all problems in one message."""
    from deepspeed.runtime.config import DeepSpeedConfig

    problems = []
    for name, spec in card.specs.items():
        if not spec.sharded:
            continue
        if spec.zero.offload_params and spec.zero.stage != 3:
            problems.append(f"expert {name!r}: offload_params needs stage 3 (got stage {spec.zero.stage})")
        if not spec.trainable and spec.zero.stage != 3:
            problems.append(f"expert {name!r} is frozen and sharded: only ZeRO stage 3 shards a frozen model "
                            f"(got stage {spec.zero.stage}); set `zero: {{stage: 3}}` or `sharded: false`")
        if spec.lora is not None and spec.zero.stage == 3:
            problems.append(f"expert {name!r}: LoRA adapters are added after construction; use stage 2")
        config = deepspeed_config(spec)
        try:
            DeepSpeedConfig(copy.deepcopy(config), mpu=None)
        except Exception as err:
            problems.append(f"expert {name!r}: DeepSpeed rejects its config {config}: {type(err).__name__}: "
                            f"{str(err).strip()}")
    if problems:
        raise ValueError("invalid ZeRO settings (`zero:` of sharded experts):\n  - " + "\n  - ".join(problems))


def sharded_meta(spec: Expert, world_size: int) -> dict[str, Any]:
    return {"stage": spec.zero.stage, "world_size": world_size, "precision": spec.zero.precision}
