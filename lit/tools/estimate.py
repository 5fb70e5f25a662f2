"""Per-process memory of a fit config, before anything is built at full size.

``estimate(config, devices)`` reads a ``posttrain fit`` YAML, builds every expert of its card on the
``meta`` device (a ``pretrained`` expert from its config file only: no weights are read), adds the roles the
method keeps (``reference``, ``old``, ``ema`` copies; a LoRA reference is free), and sums per process and
per component:

- **parameters** in the dtype they train in (a ``published`` expert from its catalogue config); with ``fp8`` the
  frozen Linear weights inside the blocks at 1 byte a parameter plus one scale per output row in the dtype
  (optimum-quanto's float8 e4m3), everything else in the dtype; a ZeRO-3 expert holds its 1/N partition plus the
  gathered working set DeepSpeed keeps live (``stage3_max_live_parameters`` of the config ``lit.engine.strategy``
  gives it); with ``swap_blocks`` the frozen weights of an expert's last blocks are in the ``host`` column but two
  blocks'; with the card's ``offload_encoders`` the generator's frozen text encoders are in the ``host`` column,
  and so is the VAE's encoder when the batches bring latents (``latents_cache``, ``PrecomputedVideos``); a text
  encoder whose rows come with ``PrecomputedVideos`` data is not loaded (``Expert.precomputed``, set by the rule
  ``posttrain fit`` follows: ``lit.tools.config.apply_precomputed``) and holds nothing anywhere;
- **gradients**: full under DDP (plus DDP's bucket copy when N > 1, Lightning's default
  ``gradient_as_bucket_view=False``), the 1/N partition plus the reduce bucket under ZeRO-2/3;
- **optimizer states**: the expert's own optimizer's state tensors (counted by stepping it once on a
  four-element parameter: AdamW keeps 2 per parameter) for its share of the trainable parameters (a LoRA expert:
  the adapter's alone), plus DeepSpeed's fp32
  master partition (it keeps one even for fp32 weights) and ZeRO-3's fp32 gradient sub-group buffer;
  with ``offload_optimizer`` these live in host memory (column ``host``), as do parameter partitions with
  ``offload_params``;
- **activations** of one training forward (what backward keeps: the bytes of distinct non-parameter
  storages saved for backward, traced under ``FakeTensorMode`` with 1 and 2 layers and extrapolated
  linearly to the model's layer count: nothing is allocated); gradient checkpointing adds one layer's
  recompute to the saved block inputs; with ``offload_activations`` everything saved is in the ``host`` column and
  the device keeps one block's backward working set (its recompute with checkpointing). With sequence parallelism
  (``sequence_parallel: k`` of ``ShardedExpertsStrategy``) the trace is one process of a group of k, on torch's
  fake process group: the transformer diffusers knows how to split (Wan) holds 1/k of each sample's tokens, and 1/k
  of the heads inside attention; the all-to-all's send and receive buffers of one layer are added
  (``all_to_all_bytes``).

For every sharded expert DeepSpeed's own estimator (``estimate_zero2_model_states_mem_needs`` /
``estimate_zero3_model_states_mem_needs``, which assume 16-bit weights with fp32 master and Adam) is shown
beside the table's figure.

    from posttrain.lit.tools.estimate import estimate
    print(estimate("configs/finetune.yaml", devices=8))

Not counted: frozen experts' transient activations (text encoding, VAE encoding/decoding under
``no_grad``: VAE decoding of a long rollout can be large), the CUDA context and allocator fragmentation,
communication buffers beyond the ZeRO buckets, the device copy an offloaded encoder makes for a prompt not in the
cache, and host memory beyond the offloaded tensors (the embedding cache, DataLoader workers).
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import nn

from posttrain.lit.tools.config import instantiate_part, parse
from posttrain.modules.models import presets
from posttrain.modules.models.cards import Expert, ModelCard, dtype_of
from posttrain.modules.models.generators.base import TrainingForward
from posttrain.modules.models.sequence_parallel import all_to_all_bytes, enable_sequence_parallel, traced_mesh
from posttrain.modules.rewards.base import reward_models

GIB = 2**30


@dataclass
class ComponentMemory:
    """Bytes one process holds for one component of the card."""

    name: str
    arch: str
    placement: str  # "DDP", "single", "ZeRO-2", "ZeRO-3", "frozen", "frozen copy of X", ...
    params: int  # parameter count (all of the component)
    trainable: int  # parameters that get gradients and optimizer state
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    activation_bytes: Optional[int] = None  # None: not estimated for this component
    host_bytes: int = 0  # offloaded to host memory (not in the device total)
    deepspeed_bytes: Optional[int] = None  # DeepSpeed's estimator, device side (sharded experts)
    notes: list[str] = field(default_factory=list)

    @property
    def device_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + (self.activation_bytes or 0)

    @property
    def model_state_bytes(self) -> int:
        """Parameters + gradients + optimizer states on the device (what bench/memory.py measures)."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


@dataclass
class MemoryEstimate:
    """Per-process memory of every component of a config's card."""

    config: str
    devices: int
    num_nodes: int
    components: list[ComponentMemory]
    activation_rows: str
    sequence_parallel: int  # processes sharing one sample's tokens

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    def __getitem__(self, name: str) -> ComponentMemory:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"no component {name!r}; components: {[c.name for c in self.components]}")

    @property
    def device_bytes(self) -> int:
        return sum(c.device_bytes for c in self.components)

    @property
    def host_bytes(self) -> int:
        return sum(c.host_bytes for c in self.components)

    def table(self) -> str:
        unit, scale = ("GiB", GIB) if max(self.device_bytes, self.host_bytes) >= GIB else ("MiB", 2**20)

        def num(b: Optional[int]) -> str:
            return "—" if b is None else f"{b / scale:.2f}"

        width = max(len(c.placement) for c in self.components)
        head = (f"{'component':<24} {'placement':<{width}} {'params':>9} {'weights':>9} {'grads':>9} {'optim':>9} "
                f"{'activ.':>9} {'device':>9} {'host':>9} {'DeepSpeed':>9}")
        lines = [f"posttrain estimate: {self.config}", f"per process, {self.world_size} process(es) "
                 f"({self.devices} device(s) x {self.num_nodes} node(s)"
                 + (f", sequence parallel {self.sequence_parallel}" if self.sequence_parallel > 1 else "")
                 + f"), {unit}; activations: {self.activation_rows}",
                 head, "-" * len(head)]
        for c in self.components:
            lines.append(f"{c.name:<24} {c.placement:<{width}} {c.params / 1e6:>8.2f}M {num(c.param_bytes):>9} "
                         f"{num(c.grad_bytes):>9} {num(c.optimizer_bytes):>9} {num(c.activation_bytes):>9} "
                         f"{num(c.device_bytes):>9} {num(c.host_bytes):>9} {num(c.deepspeed_bytes):>9}")
        lines.append("-" * len(head))
        lines.append(f"{'total':<24} {'':<{width}} {'':>9} {'':>9} {'':>9} {'':>9} {'':>9} "
                     f"{num(self.device_bytes):>9} {num(self.host_bytes):>9}")
        notes = [f"{c.name}: {n}" for c in self.components for n in c.notes]
        if notes:
            lines += ["notes:"] + [f"  - {n}" for n in notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def estimate(config: str, devices: Optional[int] = None, num_nodes: Optional[int] = None,
             batch_size: Optional[int] = None, activations: bool = True,
             sequence_parallel: Optional[int] = None, random_weights: bool = False) -> MemoryEstimate:
    """Per-process memory of parameters, gradients, optimizer states and activations of every expert of a
    ``posttrain fit`` config, for ``devices`` x ``num_nodes`` processes and each expert's ZeRO stage,
    offload and precision. Nothing is built at full size.

    Args:
        config: a fit YAML (``configs/*.yaml``, ``configs/recipes/*.yaml``).
        devices: processes per node; default ``trainer.devices`` of the config (must then be a number).
        num_nodes: default ``trainer.num_nodes`` of the config (1).
        batch_size: rows of one training forward of the generator; default the config's data batch size
            (times the group size K, divided by the minibatches, doubled under CFG, for the RL methods).
        activations: trace activations (a few seconds per trainable expert); False leaves them out.
        sequence_parallel: processes sharing one sample's tokens; default the config's
            ``trainer.strategy.init_args.sequence_parallel`` (``ShardedExpertsStrategy``), else 1.
        random_weights: size the config as ``posttrain fit --random_weights true`` runs it (every ``pretrained``
            folder read as the published model its name names; no folder needed).

    Returns:
        a ``MemoryEstimate``; ``print`` it for the table.
    """
    cfg = parse(config, "estimate", random_weights)
    devices = _count("trainer.devices", devices if devices is not None else cfg.trainer.devices, config)
    num_nodes = _count("trainer.num_nodes", num_nodes if num_nodes is not None else (cfg.trainer.num_nodes or 1),
                       config)
    world = devices * num_nodes
    degree = sequence_parallel if sequence_parallel is not None else _strategy_sequence_parallel(cfg)
    if not isinstance(degree, int) or degree < 1:
        raise ValueError(f"estimate: sequence_parallel is {degree!r} in {config!r}; give the number of processes "
                         f"that share one sample's tokens (1: off)")
    if world % degree:
        raise ValueError(f"estimate: sequence_parallel={degree} must divide the {world} processes (devices x "
                         f"num_nodes) of {config!r}; set it to a divisor")
    method = instantiate_part(cfg, "model", config, "estimate")  # its card unbuilt
    card: ModelCard = method.card
    data_batch = batch_size or _data_batch_size(cfg)

    # 1. every expert on the meta device, then the method's roles (copies of meta modules)
    problems = []
    for name, spec in card.specs.items():
        try:
            card.models[name] = meta_model(spec)
        except Exception as err:  # a missing config file, an unknown preset key...
            problems.append(f"expert {name!r} ({spec.arch}): {type(err).__name__}: {err}")
    if problems:
        raise ValueError(f"estimate: cannot build the card of {config!r} on the meta device:\n  - "
                         + "\n  - ".join(problems))
    method.setup_roles()
    cast, autocast = lightning_precision(getattr(cfg.trainer, "precision", None))
    if cast is not None:  # "bf16-true" and kin: Lightning casts the whole module; DeepSpeed keeps its own
        for name, model in card.models.items():
            if not card.specs[card.roles.get(name, (name,))[0]].sharded:
                card.models[name] = model.to(cast)

    # 2. per component: weights, gradients, optimizer state
    rows, rows_note = activation_rows(method, data_batch)
    whole_rows = activation_rows(method, data_batch, micro=False)[0]  # other trained experts (refiners)
    generator = getattr(getattr(method, "stage", None), "transformer", "transformer")
    components = []
    for name, model in card.models.items():
        if name in card.roles:
            of, role = card.roles[name]
            spec = card.specs[of]
            components.append(_frozen(name, spec, model, f"frozen {role} of {of}"))
        else:
            spec = card.specs[name]
            components.append(_expert(name, spec, model, world))
    for name, (of, role) in card.roles.items():
        if name not in card.models:  # a LoRA reference: the expert with its adapter off
            components.append(ComponentMemory(name, card.specs[of].arch, f"{of} with adapter off", 0, 0,
                                              notes=["no memory of its own (LoRA reference)"]))

    components += reward_memory(getattr(method, "reward", None))
    offloaded_encoders(components, card, method, cfg)
    for c in components:
        spec = card.specs.get(c.name)
        if spec is not None and spec.offload_weights:  # ModelCard.park at the start of the run
            c.host_bytes, c.param_bytes = c.host_bytes + c.param_bytes, 0
            c.placement += ", host"
            c.notes.append("offload_weights: in host memory, copied to the device for each call")
    for c in components:
        spec = card.specs.get(card.roles.get(c.name, (c.name,))[0])
        if spec is not None and spec.swap_blocks and c.name in card.models:  # ModelCard.swap, copies for roles too
            swapped, resident = swapped_block_bytes(spec, card.models[c.name])
            c.param_bytes -= swapped - resident
            c.host_bytes += swapped
            c.placement += ", blocks swapped"
            c.notes.append(f"swap_blocks={spec.swap_blocks}: {swapped / GIB:.2f} GiB of frozen block weights in host "
                           f"memory, {resident / GIB:.2f} GiB of them on the device at a time (two blocks)")
    for c in components:
        if c.name in card.unloaded:  # PrecomputedVideos data: on the meta device, never loaded (apply_precomputed)
            c.param_bytes = c.host_bytes = 0
            c.placement = "not loaded"
            c.notes.append("precomputed: its rows come with the data; no weight read, on the device or in host memory")

    # 3. activations of the trainable experts' training forward
    if activations:
        stage = getattr(method, "stage", None)
        generators = {generator, getattr(stage, "transformer_2", None)} - {None}  # a pair of noise experts: both
        saved_on_host: dict[str, int] = {}
        for c in components:
            spec = card.specs.get(c.name)
            if spec is None or not spec.trainable:
                continue
            try:
                c.activation_bytes, saved_on_host[c.name], note = activation_bytes(
                    spec, card, method, rows if c.name in generators else whole_rows, cast, autocast, degree)
                c.host_bytes += saved_on_host[c.name]
            except Exception as err:  # an architecture the trace cannot run: say so, keep the rest
                c.activation_bytes, note = None, f"activations not estimated ({type(err).__name__}: {err})"
            if note:
                c.notes.append(note)
        pair_activations_once(components, stage, saved_on_host)
    if autocast is not None:
        rows_note += f", {autocast} autocast"
    return MemoryEstimate(config, devices, num_nodes, components, rows_note, degree)


def reward_memory(reward: Any) -> list[ComponentMemory]:
    """One row per model a local reward holds (``Reward.models``: PickScore, HPSv2.1, the aesthetic predictor,
    CLIPScore): frozen weights in their dtype, no gradients, no optimizer state; a ``RemoteReward`` holds none here."""
    rows = []
    for name, model in reward_models(reward).items():
        params = list(model.parameters())
        rows.append(ComponentMemory(name, type(model).__name__, "frozen reward", _numel(params), 0,
                                    param_bytes=sum({id(p): p.numel() * p.element_size() for p in params}.values())))
    return rows


def lightning_precision(precision: Any) -> tuple[Optional[torch.dtype], Optional[torch.dtype]]:
    """(dtype Lightning casts the module to, autocast dtype) of ``trainer.precision``; DeepSpeed experts
    follow their own ``zero.precision`` instead."""
    p = str(precision or "32-true")
    if p in ("bf16-true",):
        return torch.bfloat16, None
    if p in ("16-true", "half"):
        return torch.float16, None
    if p in ("bf16-mixed", "bf16"):
        return None, torch.bfloat16
    if p in ("16-mixed", "16"):
        return None, torch.float16
    return None, None


def _count(option: str, value: Any, config: str) -> int:
    if isinstance(value, int) and value >= 1:
        return value
    if isinstance(value, str) and value.isdigit() and int(value) >= 1:
        return int(value)
    raise ValueError(f"estimate: {option} is {value!r} in {config!r}; give the number of processes "
                     f"(e.g. `devices=8`, `posttrain estimate --config {config} --devices 8`)")


def _strategy_sequence_parallel(cfg) -> Any:
    """The config's ``trainer.strategy.init_args.sequence_parallel`` (the strategy's own default when unset; 1 for
    any other strategy)."""
    import inspect

    from posttrain.lit.engine.strategy import ShardedExpertsStrategy

    strategy = getattr(cfg.trainer, "strategy", None)
    if not str(getattr(strategy, "class_path", "")).endswith(ShardedExpertsStrategy.__name__):
        return 1
    value = getattr(getattr(strategy, "init_args", None), "sequence_parallel", None)
    return value if value is not None else \
        inspect.signature(ShardedExpertsStrategy).parameters["sequence_parallel"].default


def _data_batch_size(cfg) -> int:
    data = getattr(cfg, "data", None)
    init = getattr(data, "init_args", None) if data is not None else None
    return int(getattr(init, "batch_size", None) or 1)


# ---------------------------------------------------------------------- meta models
def meta_model(spec: Expert) -> nn.Module:
    """``spec``'s model on the meta device (``presets.build_model(device="meta")``): the preset (with overrides), a
    published model's config (``Expert.published``), a trained asset's or a pretrained folder's config; no weight
    is read or allocated."""
    model = presets.build_model(spec.arch, spec.pretrained, spec.subfolder, spec.preset, dtype_of(spec.dtype),
                                lora=spec.lora, device="meta", published=spec.published)
    if not spec.trainable:
        model.requires_grad_(False)
    return model


def _numel(params: list[nn.Parameter]) -> int:
    return sum({id(p): p.numel() for p in params}.values())


def fp8_weights(spec: Expert, model: nn.Module) -> dict[int, int]:
    """id -> input features of the weights ``Expert.fp8`` stores in float8 e4m3 (optimum-quanto): the Linear layers
    ``modules.models.fp8.targets`` picks (inside the blocks, not norms, not a LoRA adapter's); embeddings, norms and
    the layers around the blocks keep the dtype."""
    if not spec.fp8:
        return {}
    from posttrain.modules.models import fp8

    return {id(layer.weight): layer.in_features for layer in map(model.get_submodule, fp8.targets(model))}


def weight_bytes(spec: Expert, model: nn.Module, fp8: Optional[dict[int, int]] = None) -> int:
    """Bytes of ``model``'s weights as the expert stores them: each in its dtype, but an fp8 weight (``fp8_weights``,
    or ``fp8`` when given) at ``fp8.bytes_per_parameter``: 1 byte a parameter plus its scale, one value per output
    row in the weight's dtype."""
    fp8 = fp8_weights(spec, model) if fp8 is None else fp8
    return sum({id(p): stored_bytes(p, fp8) for p in model.parameters()}.values())


def stored_bytes(tensor: torch.Tensor, fp8: dict[int, int]) -> int:
    """Bytes of one tensor as the expert stores it: in its dtype, or, among the ``fp8`` weights (``fp8_weights``), at
    ``fp8.bytes_per_parameter``."""
    from posttrain.modules.models.fp8 import bytes_per_parameter

    if id(tensor) in fp8:
        return round(tensor.numel() * bytes_per_parameter(fp8[id(tensor)], tensor.dtype))
    return tensor.numel() * tensor.element_size()


def swapped_block_bytes(spec: Expert, model: nn.Module) -> tuple[int, int]:
    """(bytes in host memory, bytes on the device at a time) of ``model``'s blocks that ``Expert.swap_blocks``
    swaps: the frozen tensors of its last ``swap_blocks`` blocks as the expert stores them (``weight_bytes``), of
    which ``SwappedBlocks.RESIDENT`` blocks (the largest) are on the device at once."""
    from posttrain.modules.models.fp8 import blocks
    from posttrain.modules.models.parked import SwappedBlocks

    paths = blocks(model)
    if spec.swap_blocks > len(paths):
        raise ValueError(f"swap_blocks={spec.swap_blocks}, but {type(model).__name__} has {len(paths)} blocks; swap "
                         f"at most {len(paths)}")
    fp8 = fp8_weights(spec, model)
    sizes = []
    for path in paths[len(paths) - spec.swap_blocks:]:
        block = model.get_submodule(path)
        frozen = {id(t): t for t in (*block.parameters(), *block.buffers()) if not t.requires_grad}
        sizes.append(sum(stored_bytes(t, fp8) for t in frozen.values()))
    return sum(sizes), sum(sorted(sizes, reverse=True)[:SwappedBlocks.RESIDENT])


def optimizer_state_bytes(spec: Expert, dtype: torch.dtype) -> int:
    """Bytes of optimizer state per parameter of ``dtype``: the state tensors of the expert's optimizer
    the size of a parameter, after one step on a four-element parameter."""
    if spec.optimizer is None:
        return 0
    p = nn.Parameter(torch.zeros(4, dtype=dtype))
    optimizer = spec.optimizer([p])
    p.grad = torch.ones_like(p)
    optimizer.step()
    state = optimizer.state.get(p, {})
    return sum(t.element_size() for t in state.values() if torch.is_tensor(t) and t.numel() == p.numel())


# ---------------------------------------------------------------------- per component
def _frozen(name: str, spec: Expert, model: nn.Module, placement: str) -> ComponentMemory:
    fp8 = fp8_weights(spec, model)
    c = ComponentMemory(name, spec.arch, placement, _numel(list(model.parameters())), 0,
                        param_bytes=weight_bytes(spec, model, fp8))
    if fp8:
        c.placement += ", fp8"
    return c


def _expert(name: str, spec: Expert, model: nn.Module, world: int) -> ComponentMemory:
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad] if spec.trainable else []
    n_all, n_train = _numel(params), _numel(trainable)
    if not spec.trainable:
        if spec.sharded:  # a frozen ZeRO-3 expert: weights partitioned, nothing else
            c = _frozen(name, spec, model, "frozen, ZeRO-3")
            c.param_bytes //= world
            if spec.zero.offload_params:
                c.host_bytes, c.param_bytes = c.param_bytes, 0
            return c
        return _frozen(name, spec, model, "frozen")
    if spec.sharded:
        return _zero(name, spec, model, world, n_all, n_train)
    # plain: full weights, gradients (same dtype) and optimizer state on every process
    # (a LoRA expert: gradients and optimizer state of the adapter alone, the only parameters that require grad)
    unique = list({id(p): p for p in trainable}.values())
    train_bytes = sum(p.numel() * p.element_size() for p in unique)
    grads = train_bytes * (2 if world > 1 else 1)
    # per dtype: the optimizer keeps its state in its parameter's dtype (a bf16 model's float32 modules: float32)
    per_dtype = {dtype: optimizer_state_bytes(spec, dtype) for dtype in {p.dtype for p in unique}}
    fp8 = fp8_weights(spec, model)
    c = ComponentMemory(name, spec.arch, "DDP" if world > 1 else "single process", n_all, n_train,
                        param_bytes=weight_bytes(spec, model, fp8), grad_bytes=grads,
                        optimizer_bytes=sum(p.numel() * per_dtype[p.dtype] for p in unique))
    if world > 1:
        c.notes.append("gradients counted twice: .grad and DDP's bucket (gradient_as_bucket_view=False)")
    if spec.lora is not None:
        c.placement += ", LoRA"
    if fp8:
        c.placement += ", fp8 base"
    return c


def _zero(name: str, spec: Expert, model: nn.Module, world: int, n_all: int, n_train: int) -> ComponentMemory:
    """ZeRO-2/3 bytes per process as DeepSpeed 0.16-0.19 lays them out for the config ``lit.engine.strategy`` gives."""
    from posttrain.lit.engine.strategy import deepspeed_config

    zero = spec.zero
    low = 2 if zero.precision == "bf16" else 4  # the engine's working weights and gradients
    ds = deepspeed_config(spec, model)["zero_optimization"]
    bucket = int(ds.get("reduce_bucket_size", 5e8))
    states = optimizer_state_bytes(spec, torch.float32)  # DeepSpeed steps the fp32 master partition
    frozen = n_all - n_train
    part = math.ceil(n_train / world)
    c = ComponentMemory(name, spec.arch, f"ZeRO-{zero.stage} {zero.precision}", n_all, n_train)
    optimizer_side = part * (4 + states)  # fp32 master partition + states (a copy even for fp32 weights)
    if zero.stage == 2:
        c.param_bytes = n_all * low
        c.grad_bytes = part * low + min(bucket, n_train) * low
        if zero.precision == "bf16":
            optimizer_side += part * 4  # the fp32 gradient partition the step converts to
    else:
        live = int(ds.get("stage3_max_live_parameters", 1e9))
        partition = math.ceil(n_all / world) * low
        gathered = min(live, n_all) * low
        c.param_bytes = gathered + (0 if zero.offload_params else partition)
        c.grad_bytes = part * low + min(bucket, n_train) * low
        optimizer_side += min(int(ds.get("sub_group_size", 1e9)), part) * 4  # fp32 grad buffer of a sub-group
        if zero.offload_params:
            c.host_bytes += partition
        c.notes.append(f"ZeRO-3 keeps up to {min(live, n_all) / 1e6:.1f}M gathered parameters live "
                       f"(stage3_max_live_parameters)")
    if zero.offload_optimizer:  # ZeRO-Offload: master, states and the gradient partition (fp32) on the host
        c.host_bytes += optimizer_side + part * 4
        c.grad_bytes -= part * low
    else:
        c.optimizer_bytes = optimizer_side
    if frozen:
        c.notes.append(f"{frozen / 1e6:.1f}M frozen parameters (LoRA base) counted as weights only")
    c.deepspeed_bytes = deepspeed_estimate(spec, model, world)
    if zero.precision != "bf16":
        c.notes.append("DeepSpeed's estimator assumes 16-bit weights; this expert trains in fp32")
    return c


def deepspeed_estimate(spec: Expert, model: nn.Module, world: int, devices: Optional[int] = None) -> int:
    """DeepSpeed's own device-side estimate of model states for ``spec``'s ZeRO stage and offload."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = _numel(params)
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    if spec.zero.stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        _, device = estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=world, num_nodes=1,
                                                          cpu_offload=spec.zero.offload_optimizer)
        return int(device)
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    _, device, _ = estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=world, num_nodes=1,
                                                         cpu_offload=spec.zero.offload_optimizer,
                                                         cpu_offload_params=spec.zero.offload_params,
                                                         zero_init=True)
    return int(device)


def offloaded_encoders(components: list[ComponentMemory], card: ModelCard, method, cfg) -> None:
    """With the card's ``offload_encoders``, move to the host column what the run keeps there
    (``ModelCard.offload_paths``, ``lit.engine.encoders``): the generator's frozen text encoders, and the VAE's
    encoder where every batch brings latents (a ``latents_cache``, ``PrecomputedVideos``) and the generator reads no
    image; the device keeps the rest (the VAE's decoder)."""
    stage = getattr(method, "stage", None)
    if not card.offload_encoders or stage is None:
        return
    data = getattr(cfg, "data", None)
    init = getattr(data, "init_args", None)
    latents = str(getattr(data, "class_path", "")).endswith("PrecomputedVideos") \
        or getattr(init, "latents_cache", None) is not None
    by_name = {c.name: c for c in components}
    for path in card.offload_paths(stage, latents):
        name, _, sub = path.partition(".")
        if card.specs[name].trainable:  # as the run's ModelCard.park refuses it
            raise ValueError(f"estimate: offload_encoders cannot keep {path!r} in host memory: expert {name!r} trains")
        c = by_name.get(name)
        if c is None:
            continue
        moved = weight_bytes(card.specs[name], card.models[name].get_submodule(sub)) if sub else c.param_bytes
        c.host_bytes, c.param_bytes = c.host_bytes + moved, c.param_bytes - moved
        if sub:
            c.notes.append(f"offload_encoders: its {sub} ({moved / 2**20:.0f} MiB) in host memory: the batches bring "
                           f"latents")
        else:
            c.placement += ", host"
            c.notes.append("offload_encoders: in host memory once the run's prompts are cached")


# ---------------------------------------------------------------------- activations
def pair_activations_once(components: list[ComponentMemory], stage, saved_on_host: dict[str, int]) -> None:
    """A pair of noise experts (``transformer``, ``transformer_2``: one architecture) runs each row and each step
    through one expert, so the training forward's activations are those of one expert over all rows, never of both:
    counted once (device, and host with ``offload_activations``), on the expert with the larger figure."""
    if stage is None or stage.transformer_2 is None:
        return
    pair = [c for c in components if c.name in (stage.transformer, stage.transformer_2) and c.activation_bytes]
    if len(pair) == 2:
        kept, dropped = sorted(pair, key=lambda c: c.activation_bytes, reverse=True)
        dropped.activation_bytes = 0
        dropped.host_bytes -= saved_on_host.get(dropped.name, 0)
        dropped.notes.append(f"activations counted once, on {kept.name!r}: a row or a step runs one expert of the pair")


def activation_rows(method, data_batch: int, micro: bool = True) -> tuple[int, str]:
    """Rows of one training forward of the generator, and how they were counted (``micro``: at most the
    method's ``grpo.micro_batch_size``, which only the generator's forward follows)."""
    grpo = getattr(method, "grpo", None)
    if grpo is None:
        return data_batch, f"{data_batch} rows (data batch) per training forward"
    K, minibatches = grpo.num_samples_per_prompt, grpo.num_minibatches
    rows = math.ceil(data_batch * K / minibatches)
    micro = grpo.micro_batch_size if micro else None
    # a PPO update recomputes each trained step through the rollout sampler, CFG included; a method whose update is
    # a plain forward of the policy (DiffusionNFT) says so (``update_runs_rollout_cfg``)
    sampler = getattr(method, "rollout_sampler", None)
    cfg = sampler is not None and sampler.guidance_scale != 1.0 and getattr(method, "update_runs_rollout_cfg", True)
    text = f"{data_batch} prompts x K={K}" + (f" / {minibatches} minibatches" if minibatches > 1 else "")
    if micro is not None and micro < rows:
        rows, text = micro, text + f", in micro-batches of {micro}"
    if cfg:
        rows *= 2
        text += " x 2 (CFG)"
    return rows, f"{rows} rows ({text}) per training forward of one step (each backed up before the next)"


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def activation_bytes(spec: Expert, card: ModelCard, method, rows: int, cast: Optional[torch.dtype] = None,
                     autocast: Optional[torch.dtype] = None, sequence_parallel: int = 1
                     ) -> tuple[Optional[int], int, str]:
    """(device bytes, host bytes, notes) of what one training forward of ``spec``'s model at ``rows`` rows saves for
    backward, extrapolated from fake-tensor traces with 1 and 2 layers; ``(None, 0, why)`` where no input recipe
    exists. With ``sequence_parallel`` k > 1 a model diffusers can split (``_cp_plan``: Wan) is traced as one
    process of a group of k, plus one layer's all-to-all buffers; any other runs whole on every process, as in the
    strategy. With ``offload_activations`` the saved tensors are in host memory and the device keeps one block's
    working set of the backward (its recompute under gradient checkpointing, else its saved tensors brought back)."""
    keys = presets.architecture(spec.arch).layer_keys
    if not keys:
        return None, 0, f"activations not estimated for arch {spec.arch!r}"
    config = presets.config_dict(meta_model(spec).config)
    degree = sequence_parallel if getattr(presets.model_class(spec.arch), "_cp_plan", None) is not None else 1
    trace = functools.partial(_saved_bytes, spec, card=card, method=method, rows=rows, cast=cast, autocast=autocast,
                              sequence_parallel=degree)
    one = {key: 1 for key in keys}  # every kind of block once (FLUX has double- and single-stream blocks)

    def blocks(checkpointing: Optional[bool] = None) -> tuple[int, dict[str, int]]:
        """Saved bytes with one block of each kind, and what one more block of each kind adds."""
        base = trace(_with_layers(config, one), checkpointing=checkpointing)
        return base, {key: trace(_with_layers(config, {**one, key: 2}), checkpointing=checkpointing) - base
                      for key in keys}

    base, per_block = blocks()
    total = base + sum((config[key] - 1) * per_block[key] for key in keys)
    notes = ["traced without the LoRA adapter, every weight trainable: an upper bound (peft cannot move fake "
             "tensors)"] if spec.lora is not None else []
    buffers = 0
    if degree > 1:
        buffers = _all_to_all_bytes(spec, config, card, method, rows, degree, cast, autocast)
        total += buffers
        notes.append(f"sequence parallel {degree}: 1/{degree} of each sample's tokens per process (1/{degree} of the "
                     f"heads in attention), + {buffers / 2**20:.1f} MiB all-to-all buffers (one layer's q, k, v)")
    elif sequence_parallel > 1:
        notes.append(f"sequence parallel {sequence_parallel} does not apply (diffusers has no context-parallel plan "
                     f"for {type(meta_model(spec)).__name__}): whole samples on every process")
    # the backward's working set of one block: with gradient checkpointing its recompute, else its saved tensors
    block = max((blocks(checkpointing=False)[1] if spec.gradient_checkpointing else per_block).values())
    if spec.offload_activations:
        notes.append(f"offload_activations: {total / GIB:.2f} GiB saved for backward in host memory; the device "
                     f"keeps one block's backward working set")
        return block + buffers, total - buffers, "; ".join(notes)  # the all-to-all buffers stay on the device
    if spec.gradient_checkpointing:
        # checkpointed blocks keep their inputs; backward recomputes one block's activations at a time
        total += block
    return total, 0, "; ".join(notes)


def _trace_dtype(spec: Expert, cast: Optional[torch.dtype], autocast: Optional[torch.dtype]
                 ) -> tuple[torch.dtype, Optional[torch.dtype]]:
    """(weights' dtype, autocast dtype) of ``spec``'s training forward: the engine's precision for a sharded expert
    (Lightning's does not apply), else Lightning's cast or the expert's dtype."""
    if spec.sharded:
        return (torch.bfloat16 if spec.zero.precision == "bf16" else torch.float32), None
    return (cast if cast is not None else dtype_of(spec.dtype)), autocast


def _all_to_all_bytes(spec: Expert, config: dict, card: ModelCard, method, rows: int, degree: int,
                      cast: Optional[torch.dtype], autocast: Optional[torch.dtype]) -> int:
    """``all_to_all_bytes`` of ``spec``'s transformer at the method's video size: the tokens its self-attention sees,
    as its adapter counts them (Wan: the patches of the latent video; FLUX: the packed image tokens and the text,
    attended jointly)."""
    shapes = input_shapes(spec.arch, config, card, method, rows)
    tokens = presets.architecture(spec.arch).adapter.attention_tokens(config, shapes)
    dtype, autocast = _trace_dtype(spec, cast, autocast)
    size = torch.empty(0, dtype=autocast or dtype).element_size()
    return all_to_all_bytes(rows, tokens, config["num_attention_heads"] * config["attention_head_dim"], degree, size)


def _with_layers(config: dict, layers: dict[str, int]) -> dict:
    """``config`` with the given numbers of layers (a transformers config's per-layer lists cut to match)."""
    out = dict(config, **layers)
    if isinstance(out.get("layer_types"), list):
        out["layer_types"] = out["layer_types"][:max(layers.values())]
    return out


def _saved_bytes(spec: Expert, config: dict, card: ModelCard, method, rows: int, cast: Optional[torch.dtype] = None,
                 autocast: Optional[torch.dtype] = None, checkpointing: Optional[bool] = None,
                 sequence_parallel: int = 1) -> int:
    """Distinct non-parameter storages saved for backward by one forward, traced on fake tensors (by one process of
    a sequence group of ``sequence_parallel``, on a fake process group)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    shapes = input_shapes(spec.arch, config, card, method, rows)
    dtype, autocast = _trace_dtype(spec, cast, autocast)
    checkpointing = spec.gradient_checkpointing if checkpointing is None else checkpointing
    fake = FakeTensorMode()
    with fake, _default_dtype(dtype):
        model = presets.build_model(spec.arch, config=config, weights="init")
        if checkpointing:
            if hasattr(model, "enable_gradient_checkpointing"):
                model.enable_gradient_checkpointing()
            else:
                model.gradient_checkpointing_enable()
        model.train()
    with contextlib.ExitStack() as group:
        if sequence_parallel > 1:  # the mesh and the hooks are made of real tensors: outside the fake mode
            enable_sequence_parallel(model, group.enter_context(traced_mesh(sequence_parallel)))
        group.enter_context(fake)
        group.enter_context(_default_dtype(dtype))
        inputs = _inputs(shapes, dtype)
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage._cdata not in params:
                saved[storage._cdata] = storage.nbytes()
            return t

        mixed = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mixed:
            model(**inputs)
    return sum(saved.values())


def input_shapes(arch: str, config: dict, card: ModelCard, method, rows: int) -> dict[str, tuple]:
    """Shapes of one training forward's inputs, from the architecture (a generator's adapter) at the method's
    size (from the meta card; no tensor is made here)."""
    architecture = presets.architecture(arch)
    if architecture.adapter is None:  # an LM: its prompt and the tokens it generates
        forward = TrainingForward(rows, card.text_max_length + getattr(method, "max_new_tokens", 0))
        return architecture.training_inputs(config, forward)
    if method.stage.vae not in card.models:
        raise ValueError(f"estimate: the generator's latent size needs the card's `{method.stage.vae}`")
    forward = TrainingForward(rows, card.text_max_length, method.stage.latent_shape(method.video), method.stage)
    return architecture.training_inputs(config, forward)


def _inputs(shapes: dict[str, tuple], dtype: torch.dtype) -> dict:
    """Tensors of ``shapes`` (fake ones inside ``FakeTensorMode``): floats in ``dtype``, ids, timesteps; a value that
    is no shape tuple is an input as it is (Qwen-Image's ``img_shapes``, a list)."""
    inputs: dict[str, Any] = {}
    for name, shape in shapes.items():
        if not isinstance(shape, tuple):
            inputs[name] = shape
        elif name == "input_ids":
            inputs[name] = torch.zeros(shape, dtype=torch.long)
        elif name == "timestep":
            inputs[name] = torch.full(shape, 500.0)
        else:
            inputs[name] = torch.randn(shape, dtype=dtype)
    if "hidden_states" in inputs:
        inputs["return_dict"] = False
    return inputs
