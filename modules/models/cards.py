"""A model is a card of named experts.

A ``ModelCard`` lists components by name (``text_encoder``, ``vae``, ``transformer``, ``refiner_0``…,
``critic``), each an ``Expert``: a real model class from ``presets.py`` plus how it trains (optimizer,
scheduler, clipping, accumulation) and whether it is sharded in its own DeepSpeed engine. Methods ask
the card for *roles* — frozen copies such as ``transformer_reference`` or ``transformer_old`` — and the
card keeps one integer weight version per component, bumped by ``callbacks.versions``.

N prompt refiners are a number: ``num_refiners: 3`` with one ``refiner`` template expands to
``refiner_0``, ``refiner_1``, ``refiner_2``, each with its own weights, optimizer and version.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator, Literal, Optional

import torch
from torch import nn

from posttrain.modules.models import fp8, presets
from posttrain.modules.models.cache import EmbeddingCache
from posttrain.modules.models.parked import Parked, SwappedBlocks, Unloaded

OptimizerCallable = Callable[[Iterable], torch.optim.Optimizer]
LRSchedulerCallable = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
Role = Literal["reference", "old", "ema", "teacher", "rollout"]


@dataclass
class ZeroConfig:
    """DeepSpeed ZeRO settings of one sharded expert (used by ``lit.engine.strategy``)."""

    stage: Literal[2, 3] = 2
    offload_optimizer: bool = False
    offload_params: bool = False
    precision: Literal["fp32", "bf16"] = "fp32"
    # any further DeepSpeed config keys, merged last (e.g. {"zero_optimization": {"reduce_bucket_size": 1e6}})
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoraConfig:
    """Train the expert through a peft LoRA adapter; its ``reference`` is itself with the adapter off."""

    rank: int = 8
    alpha: float = 8.0
    target_modules: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])


@dataclass
class Expert:
    """One component of a card: a real model and how it trains."""

    arch: presets.Arch
    pretrained: Optional[str] = None
    subfolder: Optional[str] = None
    preset: dict[str, Any] = field(default_factory=dict)
    # a published model's component at real size with random weights from a fixed seed (the same card builds the
    # same weights), instead of `pretrained`: e.g. "Wan2.1-T2V-14B" (modules/models/published.py lists the names);
    # `subfolder` picks the component where the arch alone does not, `preset` overrides keys of its config
    published: Optional[str] = None
    tokenizer: Optional[str] = None  # text encoders / LMs; None = ByT5Tokenizer()
    trainable: bool = False
    optimizer: Optional[OptimizerCallable] = None
    scheduler: Optional[LRSchedulerCallable] = None
    grad_clip: Optional[float] = 1.0
    accumulate: int = 1  # step this expert's optimizer every `accumulate` iterations
    sharded: bool = False
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    lora: Optional[LoraConfig] = None
    gradient_checkpointing: bool = False
    # the tensors the training forward saves for backward (with gradient checkpointing: the block inputs) go to
    # host memory during the forward and come back for backward (torch.autograd.graph.save_on_cpu)
    offload_activations: bool = False
    # a frozen expert's weights wait in host memory (pinned on CUDA) and come to the device for each call, from the
    # start of fit, validate or predict (``Parked``): the frozen expert of a pair of noise experts, which runs only the
    # steps of its range, or a frozen teacher. Costs one copy of the weights over the link per call
    offload_weights: bool = False
    # the frozen weights of the last `swap_blocks` repeated blocks (Wan's `blocks`, FLUX's single-stream blocks last)
    # wait in host memory, pinned on CUDA, and come to the device one block at a time for its forward and, under
    # gradient checkpointing (required when it trains), its recompute in backward; two blocks resident at a time
    # (``SwappedBlocks``). A LoRA adapter inside them stays on the device. Costs two copies of those blocks over the
    # link per training iteration, one per sampling step; musubi-tuner's `--blocks_to_swap`
    swap_blocks: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"
    # the Linear layers of its blocks stored in float8 (e4m3, a scale per output channel; optimum-quanto) and computed
    # in `dtype`: a frozen expert, or the base of a LoRA expert (the adapter stays in `dtype`); modules/models/fp8.py
    fp8: bool = False
    # start from the weights of this other expert of the card, after both are built (e.g. a DMD2 student
    # and critic from the teacher; a block-causal student from a bidirectional teacher of the same config)
    init_from: Optional[str] = None
    # diffusers attention backend of a diffusers model (e.g. "flash", "_native_cudnn", "native"); None keeps SDPA
    attention_backend: Optional[str] = None
    # torch.compile in place (state dict unchanged): the model's forward; a VAE's encoder and decoder, which its
    # encode/decode call (they never call its forward)
    compile: bool = False
    # convolution weights in channels-last memory (Conv3d: channels_last_3d, Conv2d: channels_last), so a conv
    # net's activations follow; values unchanged, kernels rounded differently (~1e-5). What pays: a VAE on the CPU,
    # whose decoder normalises over channels (bench/decode.py)
    channels_last: bool = False
    # a frozen text encoder whose rows come precomputed (`posttrain preprocess`, then `--data PrecomputedVideos`):
    # built on the meta device (shapes and dtype only: no weight file read, nothing allocated) and never moved; a
    # prompt not among the cached rows is an error naming it. None: follow the data (`posttrain fit` sets true on the
    # frozen text encoders whose rows a PrecomputedVideos folder holds: lit/tools/config.py); false: always load it
    precomputed: Optional[bool] = None

    def __post_init__(self):
        # `--…experts.NAME.init_from null` on the command line reaches a dict-valued card as the string 'None'
        # (jsonargparse 4.x, through the model's class_path); read it, and 'null', as the null it was
        for key in ("pretrained", "published", "subfolder", "tokenizer", "init_from", "attention_backend",
                    "precomputed"):
            if getattr(self, key) in ("None", "null"):
                setattr(self, key, None)


def published_problems(name: str, spec: Expert) -> list[str]:
    """What is wrong with expert ``name``'s ``published`` setting: a name or component the catalogue does not know
    (``modules/models/published.py``), or a ``pretrained`` folder beside it."""
    from posttrain.modules.models import published

    problems = []
    if spec.pretrained is not None:
        problems.append(f"both pretrained={spec.pretrained!r} and published={spec.published!r}: published builds random "
                        f"weights of that architecture, pretrained loads the folder's; keep one (on the command line: "
                        f"--model.init_args.card.experts.{name}.published null)")
    if spec.sharded and spec.zero.stage == 3:
        problems.append(f"published={spec.published!r} with ZeRO-3 (sharded, zero.stage 3): a ZeRO-3 expert is built "
                        f"partitioned from a folder's weights; use zero.stage 2, or a `pretrained` folder")
    if spec.arch in presets.PRESETS:
        try:
            published.component(spec.published, spec.arch, spec.subfolder)
        except ValueError as err:
            problems.append(str(err))
    return problems


def swap_problems(spec: Expert) -> list[str]:
    """What keeps an expert from ``swap_blocks`` (before it is built; ``ModelCard.swap`` checks the block count)."""
    n = spec.swap_blocks
    if not isinstance(n, int) or n < 0:
        return [f"swap_blocks={n!r} must be a number of blocks >= 0 (0: none)"]
    if spec.sharded:
        return [f"swap_blocks={n} with sharded=true: DeepSpeed places a sharded expert's weights itself; use "
                f"zero.offload_params, or drop sharded"]
    if spec.offload_weights or spec.precomputed:
        return [f"swap_blocks={n} with {'offload_weights' if spec.offload_weights else 'precomputed'}: the whole "
                f"expert is already off the device; drop swap_blocks"]
    if spec.trainable and spec.lora is None:
        return [f"swap_blocks={n} swaps a block's frozen weights, but the expert trains all of them: train a LoRA "
                f"adapter (lora: {{rank: ...}}), or shard it (sharded: true, zero.offload_params)"]
    if not spec.gradient_checkpointing:
        return [f"swap_blocks={n}: a block's weights leave the device after its forward, and backward reads them "
                f"again only through the recomputed forward of gradient checkpointing: set "
                f"gradient_checkpointing: true"]
    return []


def precomputed_problems(name: str, spec: Expert) -> list[str]:
    """What keeps expert ``name`` from ``precomputed: true``: only a frozen text encoder whose weights a source names
    (a file, the shipped asset, a published seed) may stay unloaded, its rows checked against that source."""
    problems = []
    fix = f"or set experts.{name}.precomputed: false"
    if spec.arch in presets.PRESETS and presets.architecture(spec.arch).kind != "text_encoder":
        problems.append(f"precomputed: true, but {spec.arch!r} is no text encoder (only text-encoder rows come "
                        f"precomputed); set experts.{name}.precomputed: false")
    if spec.trainable or spec.lora is not None:
        problems.append(f"precomputed: true leaves the model unloaded, and {name!r} trains "
                        f"({'a LoRA adapter' if spec.lora is not None else 'trainable: true'}); {fix}")
    if spec.sharded:
        problems.append(f"precomputed: true with sharded: true: nothing of an unloaded model is there to shard; drop "
                        f"sharded, {fix}")
    if spec.init_from is not None:
        problems.append(f"precomputed: true with init_from={spec.init_from!r}: an unloaded model takes no weights; "
                        f"{fix}")
    if spec.arch in presets.PRESETS and spec.published is None and \
            not presets.loads_weights(spec.arch, spec.pretrained, spec.preset):
        problems.append(f"precomputed: true, but its weights are random preset weights (preset {spec.preset}), which "
                        f"no record of the rows can name: only the built model tells whether the rows are its; give "
                        f"it a `pretrained` folder (or no preset override, for the shipped asset), {fix}")
    return problems


def dtype_of(name: str) -> torch.dtype:
    """An ``Expert.dtype`` name as a torch dtype."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


class ModelCard(nn.Module):
    """Named experts, their roles and their weight versions.

    Args:
        experts: component name -> ``Expert``. Names are free; methods look up ``transformer``,
            ``text_encoder``, ``vae``, ``critic``, ``refiner_i`` by name.
        num_refiners: how many copies of ``refiner`` to add, named ``refiner_0``…``refiner_{N-1}``.
        refiner: the template of every refiner LM (independent weights and optimizer each).
        text_max_length: tokens per prompt for the text encoder.
        cache_size: prompt-embedding rows kept in memory (least recently used dropped first); rows keep the
            text encoder's dtype.
        cache_device: keep cached rows where the encoder runs (``model``) or in host memory (``cpu``; they
            move to the device per batch) — at 512×4096 bf16 a row is 4 MiB.
        offload_encoders: keep the frozen text encoders in host memory, and the VAE's encoder too when the data
            brings latents; the run's prompts are encoded at the start of fit, before the model goes to the device
            (``lit.engine.encoders``), and a prompt not in the cache brings its encoder over for that call. Needs
            ``cache_device: cpu``. Off by default: each miss copies the encoder to the device (UMT5-XXL: 11 GiB).
        boundary_ratio: a pair of noise experts (Wan 2.2 A14B): ``transformer`` denoises the steps whose timestep
            is >= ``boundary_ratio · num_train_timesteps``, ``transformer_2`` the rest (diffusers' ``WanPipeline``
            names and rule; Wan2.2-T2V-A14B: 0.875). Set exactly when the card has a ``transformer_2``.
    """

    def __init__(self, experts: dict[str, Expert], num_refiners: int = 0, refiner: Optional[Expert] = None,
                 text_max_length: int = 64, cache_size: int = 8192, cache_device: Literal["model", "cpu"] = "model",
                 offload_encoders: bool = False, boundary_ratio: Optional[float] = None):
        super().__init__()
        specs = dict(experts)
        for i in range(num_refiners):
            if refiner is None:
                break
            specs[f"refiner_{i}"] = copy.deepcopy(refiner)
        self.specs: dict[str, Expert] = specs
        self.num_refiners = num_refiners
        self.text_max_length = text_max_length
        self.cache_size_problem = f"cache_size={cache_size} must be >= 1" if cache_size < 1 else None
        self.offload_problem = ("offload_encoders=true keeps the text encoders in host memory, and their rows with "
                                "them: set `cache_device: cpu`") if offload_encoders and cache_device != "cpu" else None
        self.boundary_ratio = boundary_ratio
        self._refiner_template = refiner
        self.validate()
        self.models = nn.ModuleDict()
        self.tokenizers: dict[str, Any] = {}
        self.roles: dict[str, tuple[str, str]] = {}  # role component name -> (source expert, role)
        self.versions: dict[str, int] = {name: 0 for name in specs}
        # expert -> what runs its forward instead of the model itself (``route``); a plain dict, so the
        # runners are not submodules of the card (its state dict holds the models alone)
        self._runners: dict[str, Callable[..., Any]] = {}
        self.cache = EmbeddingCache(max_entries=cache_size, device="cpu" if cache_device == "cpu" else None)
        self.offload_encoders = offload_encoders
        self.parked: dict[str, Parked] = {}  # path of a module kept in host memory (``park``)
        self.swapped: dict[str, SwappedBlocks] = {}  # expert whose last blocks wait in host memory (``swap``)
        self.guards: dict[str, Unloaded] = {}  # expert built on the meta device (``Expert.precomputed``)

    def optimizer_for(self, name: str, params) -> torch.optim.Optimizer:
        """Expert ``name``'s optimizer over ``params``; a refused setting names the expert's option."""
        try:
            return self.specs[name].optimizer(params)
        except (ValueError, TypeError) as err:
            raise ValueError(f"expert {name!r} optimizer: {err}; fix model.card.experts.{name}.optimizer.init_args "
                             f"(e.g. a learning rate > 0)") from err

    # ------------------------------------------------------------------ construction
    def validate(self) -> None:
        """All configuration problems of the card in one message."""
        problems = []
        missing: dict[str, None] = {}  # pretrained folders that do not exist, in card order
        if self.text_max_length < 1:
            problems.append(f"text_max_length={self.text_max_length} must be >= 1 token per prompt (e.g. 64; Wan "
                            f"pipelines use 512)")
        if self.num_refiners < 0:
            problems.append(f"num_refiners={self.num_refiners} must be >= 0")
        if self.num_refiners > 0 and self._refiner_template is None:
            problems.append(f"num_refiners={self.num_refiners} needs a `refiner:` expert template")
        for name, spec in self.specs.items():
            if "." in name or "/" in name or not name:
                problems.append(f"expert name {name!r}: use letters, digits and '_' only")
            if spec.arch not in presets.PRESETS:
                problems.append(f"expert {name!r}: unknown arch {spec.arch!r}; choose one of {sorted(presets.PRESETS)}")
            if spec.trainable and spec.optimizer is None:
                problems.append(f"expert {name!r} is trainable but has no optimizer; add "
                                f"`optimizer: {{class_path: torch.optim.AdamW, init_args: {{lr: 1e-4}}}}`")
            if not spec.trainable and (spec.optimizer is not None or spec.scheduler is not None):
                problems.append(f"expert {name!r} has an optimizer or scheduler but trainable=false: set `trainable: true` to train "
                                f"it, or remove its optimizer and scheduler")
            if spec.accumulate < 1:
                problems.append(f"expert {name!r}: accumulate={spec.accumulate} must be >= 1")
            if spec.pretrained is not None and (err := presets.check_pretrained(spec.pretrained)):
                problems.append(f"expert {name!r}: {err}")
                missing.setdefault(spec.pretrained)
            if spec.published is not None:
                problems += [f"expert {name!r}: {problem}" for problem in published_problems(name, spec)]
            if spec.lora is not None and not spec.trainable:
                problems.append(f"expert {name!r} has a LoRA adapter but trainable=false")
            if spec.fp8 and spec.trainable and spec.lora is None:
                problems.append(f"expert {name!r}: fp8 stores frozen weights, and {name!r} trains all of its weights "
                                f"(trainable without lora); add a `lora:` adapter (its base may be fp8) or drop fp8")
            if spec.fp8 and spec.sharded:
                problems.append(f"expert {name!r}: fp8 with sharded=true: DeepSpeed flattens a sharded expert's "
                                f"weights into its own buffers, which float8 weights are not; drop one of the two")
            if spec.init_from is not None and spec.pretrained is not None:
                problems.append(f"expert {name!r}: both pretrained={spec.pretrained!r} and init_from={spec.init_from!r}; "
                                f"init_from would copy {spec.init_from!r}'s weights over the folder's. Keep one (on the "
                                f"command line: --model.init_args.card.experts.{name}.init_from null)")
            if spec.init_from is not None:
                source = self.specs.get(spec.init_from)
                if source is None or spec.init_from == name:
                    problems.append(f"expert {name!r}: init_from={spec.init_from!r} is not another expert of the "
                                    f"card; choose one of {sorted(n for n in self.specs if n != name)}")
                elif source.init_from is not None:
                    problems.append(f"expert {name!r}: init_from={spec.init_from!r}, which itself has init_from="
                                    f"{source.init_from!r}; point {name!r} at {source.init_from!r} directly")
            if spec.channels_last and spec.sharded:
                problems.append(f"expert {name!r}: channels_last with sharded=true: DeepSpeed flattens a sharded "
                                f"expert's weights into its own buffers; drop one of the two")
            if spec.attention_backend is not None and spec.arch not in presets.DIFFUSERS_ARCHS:
                problems.append(f"expert {name!r}: attention_backend is a diffusers option; {spec.arch!r} is a "
                                f"transformers model")
            if spec.precomputed:
                problems += [f"expert {name!r}: {problem}" for problem in precomputed_problems(name, spec)]
            if spec.offload_weights and (spec.trainable or spec.lora is not None or spec.sharded or spec.precomputed):
                why = "it trains" if spec.trainable or spec.lora is not None else \
                    "DeepSpeed places a sharded expert" if spec.sharded else "it is not loaded (precomputed)"
                problems.append(f"expert {name!r}: offload_weights keeps a frozen expert's weights in host memory, "
                                f"but {why}; drop offload_weights")
            if spec.swap_blocks:
                problems += [f"expert {name!r}: {problem}" for problem in swap_problems(spec)]
            if spec.init_from is not None and self.specs.get(spec.init_from, spec).precomputed:
                problems.append(f"expert {name!r}: init_from={spec.init_from!r}, whose weights are not loaded "
                                f"(precomputed: true); set experts.{spec.init_from}.precomputed: false")
        if missing:  # never "drop `pretrained`": that would train the tiny preset in its place
            problems.append("give a local folder holding the weights: download them once (nothing downloads at run "
                            "time) with " + "; ".join(f"`huggingface-cli download <repo> --local-dir {folder}`"
                                                       for folder in missing) +
                            " (<repo>: the model's hub id, as a recipe's header names it); to size a run without the "
                            "weights, `python scripts/config_folders.py --out "
                            f"{next(iter(missing)).rstrip('/').rpartition('/')[0] or '.'}` writes config-only folders "
                            "for `posttrain estimate`")
        if self.cache_size_problem:
            problems.append(self.cache_size_problem)
        if self.offload_problem:
            problems.append(self.offload_problem)
        problems += self.pair_problems()
        if problems:
            raise ValueError("invalid model card:\n  - " + "\n  - ".join(problems))

    def pairs(self) -> list[str]:
        """The low-noise experts of the card's pairs of noise experts: each generator ``X_2`` beside a generator
        ``X``."""
        def generator(name: str) -> bool:
            spec = self.specs.get(name)
            return spec is not None and spec.arch in presets.PRESETS and \
                presets.architecture(spec.arch).kind == "generator"

        return [name for name in self.specs if name.endswith("_2") and generator(name) and generator(name[:-2])]

    def pair_problems(self) -> list[str]:
        """A ``boundary_ratio`` without a pair of generators ``X``, ``X_2`` to hand over between, or the other way
        round."""
        pairs = self.pairs()
        if self.boundary_ratio is None:
            return [f"expert {name!r} is the low-noise expert of a pair with {name[:-len('_2')]!r}: set the card's "
                    f"boundary_ratio (where the pair hands over, a fraction of the train timesteps; Wan2.2-T2V-A14B: "
                    f"0.875, I2V: 0.9)" for name in pairs]
        problems = []
        if not 0.0 < self.boundary_ratio < 1.0:
            problems.append(f"boundary_ratio={self.boundary_ratio} must be in (0, 1) (Wan2.2-T2V-A14B: 0.875)")
        if not pairs:
            problems.append(f"boundary_ratio={self.boundary_ratio} hands the low-noise steps to `transformer_2`, "
                            f"which the card lacks: add a `transformer_2` expert, or drop boundary_ratio")
        return problems

    @property
    def built(self) -> bool:
        return len(self.models) > 0

    def build(self, build_expert: Optional[Callable[[str, Expert], Optional[nn.Module]]] = None) -> None:
        """Build every expert (random tiny preset or ``from_pretrained``) and freeze the frozen ones.

        ``build_expert(name, expert)`` may build an expert its own way and return it (None: the usual way),
        e.g. partitioned under ``deepspeed.zero.Init`` for an expert too large to build whole on one process.
        An expert with ``init_from`` then takes the named expert's weights (before any LoRA adapter is added).
        """
        built = {}
        # an expert copied from or into (init_from) is quantized after the copy, which reads and writes full weights
        copied = {name for name, spec in self.specs.items() if spec.init_from is not None} | {
            spec.init_from for spec in self.specs.values() if spec.init_from is not None}
        for name, spec in self.specs.items():
            if spec.precomputed:  # shapes and dtype only: nothing read, nothing allocated (fp8 quantizes nothing)
                built[name] = presets.build_model(spec.arch, spec.pretrained, spec.subfolder, spec.preset,
                                                  dtype_of(spec.dtype), published=spec.published, device="meta")
                continue
            try:
                model = build_expert(name, spec) if build_expert is not None else None
                built[name] = model if model is not None else presets.build_model(
                    spec.arch, spec.pretrained, spec.subfolder, spec.preset, dtype_of(spec.dtype),
                    published=spec.published, fp8=spec.fp8 and name not in copied)
            except ValueError as err:
                raise ValueError(f"expert {name!r}: {err}") from err
        for name, spec in self.specs.items():
            if spec.init_from is not None:
                # block expansion where both architectures lay out their blocks alike (a causal student of a Wan)
                arch, source = presets.architecture(spec.arch), presets.architecture(self.specs[spec.init_from].arch)
                alike = (arch.blocks, arch.residual_outputs) == (source.blocks, source.residual_outputs)
                hidden, differ = widening(arch, built[spec.init_from], built[name]) if alike else (None, [])
                what = f"expert {name!r} (init_from={spec.init_from!r}" + (
                    f"; they differ in {', '.join(differ)}, which widening keeps" if differ else "") + ")"
                copy_weights(built[spec.init_from], built[name], what, blocks=arch.blocks if alike else None,
                             residual_outputs=arch.residual_outputs, widen=hidden)
        for name, spec in self.specs.items():
            model = built[name]
            tokenizer = presets.tokenizer_of(spec.arch, spec.tokenizer, model.config)
            if tokenizer is not None:
                self.tokenizers[name] = tokenizer
            if spec.precomputed:  # frozen, never moved, never run (``Unloaded``)
                self.models[name] = freeze(model)
                self.guards[name] = Unloaded(model, name)
                continue
            if spec.fp8 and name in copied:
                fp8.quantize(model)
            if spec.fp8 and not fp8.is_quantized(model):
                raise ValueError(f"expert {name!r}: fp8=true, but {type(model).__name__} has no Linear layer inside "
                                 f"repeated blocks to store in float8; remove the option")
            if spec.lora is not None:  # after init_from and fp8: the copied weights are the adapter's base
                presets.add_lora(model, spec.lora)
            if spec.gradient_checkpointing and hasattr(model, "enable_gradient_checkpointing"):
                model.enable_gradient_checkpointing()
            elif spec.gradient_checkpointing:
                model.gradient_checkpointing_enable()
            if spec.attention_backend is not None:
                model.set_attention_backend(spec.attention_backend)
            if spec.channels_last and not to_channels_last(model):
                raise ValueError(f"expert {name!r}: channels_last=true, but {type(model).__name__} has no 2-D or 3-D "
                                 f"convolution to lay out; remove the option")
            if spec.compile:
                compile_in_place(model)
            self.models[name] = model
            if not spec.trainable:
                freeze(model)

    def add_role(self, role: Role, of: str) -> str:
        """A frozen copy of expert ``of`` for ``role``, registered as component ``f"{of}_{role}"``.

        A LoRA expert's ``reference`` is no copy: it is the expert with its adapter switched off
        (see ``use``), the usual memory saver in diffusion RL.
        """
        if of not in self.specs:
            raise KeyError(f"no expert {of!r} on the card; experts: {sorted(self.specs)}")
        name = f"{of}_{role}"
        if name in self.roles:
            return name
        self.roles[name] = (of, role)
        self.versions[name] = self.versions[of]
        if role == "reference" and self.specs[of].lora is not None:
            return name
        clone = copy.deepcopy(self.models[of], fp8.shared(self.models[of]))  # float8 weights: shared, never train
        freeze(clone)
        self.models[name] = clone
        return name

    # ------------------------------------------------------------------ access
    def __getitem__(self, name: str) -> nn.Module:
        """The module that runs component ``name``: its model (``card.models[name]``, always the model itself),
        or, for an expert a strategy routed (``route``), the model whose forward runs through that runner. A
        LoRA reference is its source (use ``card.use(name)`` to run it with the adapter off)."""
        source = self.roles[name][0] if name in self.roles and name not in self.models else name
        if source not in self.models:
            raise KeyError(f"no component {name!r} on the card; components: {sorted(self.models)}")
        model = self.models[source]
        runner = self._runners.get(source)
        return model if runner is None else Routed(model, runner)

    def route(self, name: str, runner: Callable[..., Any]) -> None:
        """Run expert ``name``'s forward through ``runner`` from now on (a DeepSpeed engine: its forward registers
        the backward hooks its ZeRO optimizer needs). ``card.models[name]`` stays the model."""
        self._runners[name] = runner

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[nn.Module]:
        """The module to run for component ``name`` (adapters off for a LoRA reference)."""
        if name in self.roles and name not in self.models:
            model = self.models[self.roles[name][0]]
            model.disable_adapters()
            try:
                yield self[name]
            finally:
                model.enable_adapters()
        else:
            yield self[name]

    def has(self, name: str) -> bool:
        return name in self.specs or name in self.roles

    @property
    def trainable(self) -> list[str]:
        return [name for name, spec in self.specs.items() if spec.trainable]

    @property
    def refiners(self) -> list[str]:
        return [f"refiner_{i}" for i in range(self.num_refiners)]

    def parameters_of(self, name: str) -> list[nn.Parameter]:
        return [p for p in self.models[name].parameters() if p.requires_grad]

    def signature(self) -> dict[str, dict[str, Any]]:
        """What a checkpoint must match to be loaded into this card: names, classes, training flags."""
        sig = {name: {"arch": spec.arch, "trainable": spec.trainable, "sharded": spec.sharded,
                      "lora": spec.lora is not None} for name, spec in self.specs.items()}
        low = self.pairs() if self.boundary_ratio is not None else []
        for name, spec in self.specs.items():  # written only when set, so checkpoints from before still match
            if spec.fp8:  # float8 weights hold other state-dict keys (weight._data, weight._scale)
                sig[name]["fp8"] = True
            if name in low:  # where a pair of noise experts hands over
                sig[name]["boundary_ratio"] = self.boundary_ratio
        sig.update({name: {"role_of": of, "role": role} for name, (of, role) in self.roles.items()})
        return sig

    def sources(self) -> dict[str, dict[str, Any]]:
        """Where each expert's weights come from (plain types: written into checkpoints and read by export)."""
        return {name: {"arch": spec.arch, "pretrained": spec.pretrained, "published": spec.published,
                       "subfolder": spec.subfolder, "preset": dict(spec.preset), "tokenizer": spec.tokenizer,
                       "dtype": spec.dtype, "fp8": spec.fp8, "trainable": spec.trainable,
                       "lora": None if spec.lora is None else asdict(spec.lora), "init_from": spec.init_from}
                for name, spec in self.specs.items()}

    def reloadable(self) -> list[str]:
        """Experts whose frozen weights a resume rebuilds exactly from their source, so that checkpoints leave those
        weights out (``frozen_state``) and keep their digest (``weights_digest``) to refuse a source that changed.

        A source rebuilds an expert exactly when a file holds its weights (``pretrained`` or a shipped trained asset)
        or when it is a published architecture built from a fixed seed (``published``). What is left out: all of a
        frozen expert; only the base of a LoRA expert (its adapter and anything else that trains stay in
        checkpoints; a sharded one's engine saves without it: ``exclude_frozen_parameters``). Kept whole: a frozen
        expert of random preset weights, an expert built with ``init_from``; roles (EMA, old, reference) are the
        trained expert's copies (``lit/engine/resume.py`` leaves out a LoRA role's base too: it is the expert's)."""
        names = []
        for name, spec in self.specs.items():
            rebuilt = presets.loads_weights(spec.arch, spec.pretrained, spec.preset) or spec.published is not None
            frozen_part = not spec.trainable or spec.lora is not None
            if rebuilt and frozen_part and spec.init_from is None and name in self.models and not spec.precomputed:
                names.append(name)
        return names

    def frozen_state(self, name: str) -> dict[str, torch.Tensor]:
        """The state-dict entries of component ``name`` that never train: all of a frozen expert's; a LoRA model's
        base (``presets.base_keys``: every entry but the adapter's layers and the parameters that train; for a role,
        those that train in its expert)."""
        model = self.models[name]
        state = model.state_dict()
        expert = self.roles[name][0] if name in self.roles else name  # a role copies its expert's layers
        if self.specs[expert].lora is None:
            return state
        base = presets.base_keys(model, trains=self.models[expert])
        return {key: value for key, value in state.items() if key in base}

    def weights_digest(self, name: str, frozen_only: bool = False) -> str:
        """SHA-256 of expert ``name``'s weights (names, dtypes, shapes, bytes), to tell that a source changed;
        ``frozen_only``: of the weights that never train (``frozen_state``: a LoRA expert's base)."""
        if self.specs.get(name) is not None and self.specs[name].precomputed:
            raise ValueError(f"expert {name!r} is not loaded (precomputed: true): it has no weights to digest; "
                             f"compare its source instead (modules/io/precomputed.py `source_record`)")
        digest = hashlib.sha256()
        state = self.frozen_state(name) if frozen_only else self.models[name].state_dict()
        for key, tensor in sorted(state.items()):
            tensor = tensor.detach().cpu().contiguous()
            digest.update(f"{key}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            # reshape: a 0-d tensor (a float8 layer's activation scale) has no byte view
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        return digest.hexdigest()

    def describe(self) -> dict[str, Any]:
        return {name: asdict(spec) | {"optimizer": repr(spec.optimizer)} for name, spec in self.specs.items()}

    # ------------------------------------------------------------------ text
    def text_embeds(self, encoder: str, prompts: list[str],
                    compute: Callable[[list[str]], torch.Tensor]) -> torch.Tensor:
        """(B, ...) rows of frozen-encoder outputs for ``prompts``, cached by (encoder, version, prompt);
        ``compute(missing)`` encodes the prompts not cached yet (the generator adapter knows how); for an encoder not
        loaded (``precomputed``) a prompt not cached is an error naming it."""
        if encoder in self.guards:
            compute = self.guards[encoder].refuse
        return self.cache.get_or_compute(encoder, self.versions[encoder], prompts, compute)

    @property
    def unloaded(self) -> list[str]:
        """The experts built on the meta device because their rows come precomputed (``Expert.precomputed``)."""
        return [name for name, spec in self.specs.items() if spec.precomputed]

    def offload_paths(self, stage: Any, latents: bool) -> list[str]:
        """What ``offload_encoders`` keeps in host memory for the generator ``stage`` (``GeneratorStage``): its frozen
        text encoders, and its VAE's encoder where every batch brings its latents (``latents``: a ``latents_cache``,
        ``PrecomputedVideos``) and the generator reads no conditioning image (``park`` refuses a VAE that trains).
        The run parks these (``lit.engine.encoders``), ``posttrain estimate`` counts them in host memory."""
        paths = [name for name in stage.encoders  # an unloaded encoder has nothing to park
                 if not self.specs[name].trainable and not self.specs[name].precomputed]
        vae = self.models[stage.vae] if stage.vae in self.models else None
        if latents and not stage.takes_image and isinstance(getattr(vae, "encoder", None), nn.Module):
            paths.append(f"{stage.vae}.encoder")
        return paths

    def park(self, path: str, device: torch.device) -> None:
        """Keep the frozen module at ``path`` (an expert, ``text_encoder``, or part of one, ``vae.encoder``) in host
        memory, whatever moves the card; a call to it runs on ``device`` (``Parked``)."""
        name, _, sub = path.partition(".")
        if self.specs[name].trainable:
            raise ValueError(f"cannot keep {path!r} in host memory: expert {name!r} trains")
        if path not in self.parked:
            module = self.models[name].get_submodule(sub) if sub else self.models[name]
            self.parked[path] = Parked(module, device)


    def swap(self, name: str, device: torch.device) -> SwappedBlocks:
        """Keep the frozen weights of expert ``name``'s last ``swap_blocks`` blocks in host memory, one block at a
        time on ``device`` (``SwappedBlocks``), whatever moves the card; its frozen copies for roles (an ``old``
        copy sharing the float8 base) swap their base with it, block by block."""
        if name in self.swapped:
            return self.swapped[name]
        n = self.specs[name].swap_blocks
        models = [self.models[name], *(self.models[role] for role, (of, _) in self.roles.items()
                                       if of == name and role in self.models)]
        paths = fp8.blocks(models[0])
        if n > len(paths):
            raise ValueError(f"expert {name!r}: swap_blocks={n}, but {type(models[0]).__name__} has {len(paths)} "
                             f"blocks; swap at most {len(paths)}")
        blocks, tensors = [], []
        for path in paths[len(paths) - n:]:
            same = [m.get_submodule(path) for m in models]
            # the expert's frozen tensors and, in each copy, those at the same names (its adapter is blended: kept)
            frozen = {n for n, t in [*same[0].named_parameters(), *same[0].named_buffers()] if not t.requires_grad}
            blocks.append(same)
            tensors.append([t for block in same for n, t in [*block.named_parameters(), *block.named_buffers()]
                            if n in frozen])
        self.swapped[name] = SwappedBlocks(blocks, tensors, device)
        return self.swapped[name]


class Routed:
    """A model whose forward runs through a runner (``ModelCard.route``); everything else — config, parameters,
    methods such as ``generate`` or ``new_cache``, ``isinstance`` — is the model's. The one place a DeepSpeed
    engine stands in for its model: every caller of ``card[name]`` runs the engine and reads the model."""

    __slots__ = ("model", "runner")

    def __init__(self, model: nn.Module, runner: Callable[..., Any]):
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "runner", runner)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.runner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in Routed.__slots__:  # not set yet (a copy being built)
            raise AttributeError(name)
        return getattr(self.model, name)

    @property  # isinstance(card[name], WanTransformer3DModel) holds for a routed expert too
    def __class__(self):
        return type(self.model)


@torch.no_grad()
def to_channels_last(model: nn.Module) -> int:
    """Every Conv2d / Conv3d weight of ``model`` to channels-last memory in place (the same values and state-dict
    keys; ``load_state_dict`` copies into the layout); returns how many."""
    formats = {nn.Conv2d: torch.channels_last, nn.Conv3d: torch.channels_last_3d}
    count = 0
    for module in model.modules():
        fmt = next((f for kind, f in formats.items() if isinstance(module, kind)), None)
        if fmt is not None:
            module.weight.data = module.weight.data.contiguous(memory_format=fmt)
            count += 1
    return count


def compile_in_place(model: nn.Module) -> None:
    """``nn.Module.compile`` what serving runs: an autoencoder's ``encoder`` and ``decoder`` (diffusers' ``encode`` and
    ``decode`` call them, never the VAE's own forward, so compiling that would change nothing), else the forward."""
    parts = [getattr(model, name) for name in ("encoder", "decoder")
             if hasattr(model, "decode") and isinstance(getattr(model, name, None), nn.Module)]
    for part in parts or [model]:
        part.compile()


def widening(arch: presets.Architecture, source: nn.Module, target: nn.Module) -> tuple[Optional[int], list[str]]:
    """(the source's hidden size, []) where ``target`` may be a widened ``source``: both configs agree on every key
    but the architecture's ``widths`` and ``layer_keys``; (None, the keys they differ in) where they do not, and
    (None, []) for an architecture that names no width."""
    if not arch.widths or arch.hidden_size is None:
        return None, []
    configs = [presets.config_dict(m.config) for m in (source, target)]
    free = set(arch.widths) | set(arch.layer_keys)
    shared = (set(configs[0]) & set(configs[1])) - free

    def plain(value: Any) -> Any:  # a config read from JSON holds lists where a preset wrote tuples
        return list(value) if isinstance(value, tuple) else value

    differ = sorted(f"{key} ({configs[0][key]} vs {configs[1][key]})" for key in shared
                    if not key.startswith("_") and plain(configs[0][key]) != plain(configs[1][key]))
    return (None, differ) if differ else (int(arch.hidden_size(configs[0])), [])


def _widened(tensor: torch.Tensor, shape: torch.Size, hidden: int, inputs: tuple[int, ...],
             generator: torch.Generator) -> torch.Tensor:
    """``tensor`` widened to ``shape`` (each dim the same or an integer multiple r): along a dim, every run of
    ``hidden`` entries (the whole dim where it is no multiple of ``hidden``) is repeated r times in place, so a
    (6·d) projection whose consumer splits it into 6 chunks of d keeps that layout. Along the ``inputs`` dims (the
    input features of a Linear or convolution) the r copies of each weight share it at random (shares drawn in
    [0.5, 1.5] and normalised), summing to it: the layer sees each source feature r times and computes what it did,
    and the copies of a unit, fed by different shares, get different gradients (Net2Net's random split: no two
    copies stay equal)."""
    for dim, (n, m) in enumerate(zip(tensor.shape, shape)):
        if n == m:
            continue
        r, chunk = m // n, hidden if n % hidden == 0 else n
        moved = tensor.movedim(dim, 0)
        rest = moved.shape[1:]
        tiled = moved.reshape(n // chunk, 1, chunk, *rest).expand(n // chunk, r, chunk, *rest)
        if dim in inputs:
            share = 1.0 + 0.5 * (2 * torch.rand(tiled.shape, generator=generator, dtype=torch.float64) - 1)
            tiled = (tiled.double() * share / share.sum(1, keepdim=True)).to(tensor.dtype)
        tensor = tiled.reshape(m, *rest).movedim(0, dim)
    return tensor


@torch.no_grad()
def copy_weights(source: nn.Module, target: nn.Module, what: str, blocks: Optional[str] = None,
                 residual_outputs: tuple[str, ...] = (), widen: Optional[int] = None) -> None:
    """``target``'s parameters and buffers set to ``source``'s (same names and shapes, dtype of the target).

    Block expansion (LLaMA Pro, Wu et al. 2024): where ``target`` has r times the source's ``blocks`` (the name of
    their ``ModuleList``), source block i becomes target blocks r·i … r·i + r − 1, the copies after the first with
    their ``residual_outputs`` zeroed, so each copy is the identity and the deeper target computes exactly the
    source's function, every new block trainable from there.

    Widening (Net2Net, Chen et al. 2016), where ``widen`` is the source's hidden size: a tensor whose dims are
    integer multiples of the source's is the source's with every unit repeated and each Linear's or convolution's
    input weights split at random among the copies (``_widened``): the wider target computes the source's function
    (to rounding) with its copies free to part. Only for experts that differ in width alone (``widening``).

    A ZeRO-3 partitioned model (built under ``deepspeed.zero.Init``) is gathered for the copy; the target is
    written back from rank 0, where every process computed the same values.
    """
    with _gathered(source), _gathered(target, modifier=True):
        src = {**dict(source.named_parameters()), **dict(source.named_buffers())}
        dst = {**dict(target.named_parameters()), **dict(target.named_buffers())}
        origin, zeroed = {key: key for key in dst}, set()
        if blocks is not None:
            block = re.compile(rf"{re.escape(blocks)}\.(\d+)\.(.*)")  # "blocks.3.attn1.to_q.weight" -> 3, the rest
            have, want = ({m[1] for k in keys if (m := block.match(k))} for keys in (src, dst))
            have, want = len(have), len(want)
            if have and want > have:
                if want % have:
                    raise ValueError(f"{what}: the target has {want} {blocks}, the source {have}; a deeper expert "
                                     f"takes a multiple of its source's blocks (block expansion), e.g. {2 * have}")
                copies = want // have
                for key in dst:
                    if m := block.match(key):
                        index, rest = int(m[1]), m[2]
                        origin[key] = f"{blocks}.{index // copies}.{rest}"
                        if index % copies and any(rest.startswith(f"{layer}.") for layer in residual_outputs):
                            zeroed.add(key)
        missing = sorted(k for k in dst if origin[k] not in src)
        extra = sorted(set(src) - set(origin.values()))

        def widens(key: str) -> bool:
            have, want = src[origin[key]].shape, dst[key].shape
            return widen is not None and len(have) == len(want) and all(w % h == 0 for h, w in zip(have, want))

        shapes = [k for k in dst if origin[k] in src and src[origin[k]].shape != dst[k].shape and not widens(k)]
        if missing or extra or shapes:
            raise ValueError(f"{what}: the source's weights do not fit: missing {missing[:3]}, unexpected "
                             f"{extra[:3]}, other shapes "
                             f"{[(k, tuple(src[origin[k]].shape), tuple(dst[k].shape)) for k in shapes[:3]]}; give "
                             f"both experts the same architecture (arch and preset; a deeper one may take a "
                             f"multiple of its blocks, a wider one multiples of its width)")
        inputs = {f"{name}.weight" for name, module in target.named_modules()
                  if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))}
        generator = torch.Generator().manual_seed(0)  # the same widened weights on every process and every build
        for key, tensor in dst.items():
            value = src[origin[key]]
            if value.shape != tensor.shape:
                value = _widened(value, tensor.shape, widen, (1,) if key in inputs else (), generator)
            tensor.copy_(value.to(tensor.dtype))
            if key in zeroed:
                tensor.zero_()


def _gathered(model: nn.Module, modifier: bool = False):
    params = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modifier else None)


def freeze(model: nn.Module) -> nn.Module:
    """Eval mode, no gradients, zero dropout: a frozen component gives the same output for the same input."""
    model.eval()
    model.requires_grad_(False)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model
