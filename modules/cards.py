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
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Iterator, Literal, Optional

import torch
from torch import nn

from posttrain.modules import presets
from posttrain.modules.cache import EmbeddingCache

OptimizerCallable = Callable[[Iterable], torch.optim.Optimizer]
LRSchedulerCallable = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
Role = Literal["reference", "old", "ema", "teacher", "rollout"]


@dataclass
class ZeroConfig:
    """DeepSpeed ZeRO settings of one sharded expert (used by ``lit.strategy``)."""

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
    dtype: Literal["float32", "bfloat16"] = "float32"


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


class ModelCard(nn.Module):
    """Named experts, their roles and their weight versions.

    Args:
        experts: component name -> ``Expert``. Names are free; methods look up ``transformer``,
            ``text_encoder``, ``vae``, ``critic``, ``refiner_i`` by name.
        num_refiners: how many copies of ``refiner`` to add, named ``refiner_0``…``refiner_{N-1}``.
        refiner: the template of every refiner LM (independent weights and optimizer each).
        text_max_length: tokens per prompt for the text encoder.
    """

    def __init__(self, experts: dict[str, Expert], num_refiners: int = 0, refiner: Optional[Expert] = None,
                 text_max_length: int = 64):
        super().__init__()
        specs = dict(experts)
        for i in range(num_refiners):
            if refiner is None:
                break
            specs[f"refiner_{i}"] = copy.deepcopy(refiner)
        self.specs: dict[str, Expert] = specs
        self.num_refiners = num_refiners
        self.text_max_length = text_max_length
        self._refiner_template = refiner
        self.validate()
        self.models = nn.ModuleDict()
        self.tokenizers: dict[str, Any] = {}
        self.roles: dict[str, tuple[str, str]] = {}  # role component name -> (source expert, role)
        self.versions: dict[str, int] = {name: 0 for name in specs}
        self.cache = EmbeddingCache()

    # ------------------------------------------------------------------ construction
    def validate(self) -> None:
        """All configuration problems of the card in one message."""
        problems = []
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
                problems.append(f"expert {name!r} has an optimizer or scheduler but trainable=false")
            if spec.accumulate < 1:
                problems.append(f"expert {name!r}: accumulate={spec.accumulate} must be >= 1")
            if spec.pretrained is not None and (err := presets.check_pretrained(spec.pretrained)):
                problems.append(f"expert {name!r}: {err}; give a local folder or remove `pretrained`")
            if spec.lora is not None and not spec.trainable:
                problems.append(f"expert {name!r} has a LoRA adapter but trainable=false")
        if problems:
            raise ValueError("invalid model card:\n  - " + "\n  - ".join(problems))

    @property
    def built(self) -> bool:
        return len(self.models) > 0

    def build(self, init_context: Optional[Callable[[str, Expert], ContextManager]] = None) -> None:
        """Build every expert (random tiny preset or ``from_pretrained``) and freeze the frozen ones.

        ``init_context(name, expert)`` wraps each construction, e.g. ``deepspeed.zero.Init`` for an
        expert too large to build whole on one process.
        """
        for name, spec in self.specs.items():
            ctx = init_context(name, spec) if init_context is not None else contextlib.nullcontext()
            with ctx:
                model = presets.build_model(spec.arch, spec.pretrained, spec.subfolder, spec.preset,
                                            _dtype(spec.dtype))
            if spec.arch in presets.TEXT_ENCODERS or spec.arch == "qwen2":
                self.tokenizers[name] = presets.build_tokenizer(
                    spec.tokenizer, presets.tokenizer_length(spec.arch, model.config))
            if spec.lora is not None:
                from peft import LoraConfig as PeftLoraConfig

                model.requires_grad_(False)
                model.add_adapter(PeftLoraConfig(r=spec.lora.rank, lora_alpha=spec.lora.alpha,
                                                 target_modules=spec.lora.target_modules, init_lora_weights=True))
            if spec.gradient_checkpointing and hasattr(model, "enable_gradient_checkpointing"):
                model.enable_gradient_checkpointing()
            elif spec.gradient_checkpointing:
                model.gradient_checkpointing_enable()
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
        clone = copy.deepcopy(self.models[of])
        freeze(clone)
        self.models[name] = clone
        return name

    # ------------------------------------------------------------------ access
    def __getitem__(self, name: str) -> nn.Module:
        if name in self.models:
            return self.models[name]
        if name in self.roles:  # LoRA reference: the source module, use `card.use(name)` to run it
            return self.models[self.roles[name][0]]
        raise KeyError(f"no component {name!r} on the card; components: {sorted(self.models)}")

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[nn.Module]:
        """The module to run for component ``name`` (adapters off for a LoRA reference)."""
        if name in self.roles and name not in self.models:
            model = self.models[self.roles[name][0]]
            model.disable_adapters()
            try:
                yield model
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
        sig.update({name: {"role_of": of, "role": role} for name, (of, role) in self.roles.items()})
        return sig

    def sources(self) -> dict[str, dict[str, Any]]:
        """Where each expert's weights come from (plain types: written into checkpoints and read by export)."""
        return {name: {"arch": spec.arch, "pretrained": spec.pretrained, "subfolder": spec.subfolder,
                       "preset": dict(spec.preset), "tokenizer": spec.tokenizer, "dtype": spec.dtype,
                       "trainable": spec.trainable, "lora": None if spec.lora is None else asdict(spec.lora)}
                for name, spec in self.specs.items()}

    def describe(self) -> dict[str, Any]:
        return {name: asdict(spec) | {"optimizer": repr(spec.optimizer)} for name, spec in self.specs.items()}

    # ------------------------------------------------------------------ text
    def text_embeds(self, encoder: str, prompts: list[str],
                    compute: Callable[[list[str]], torch.Tensor]) -> torch.Tensor:
        """(B, ...) rows of frozen-encoder outputs for ``prompts``, cached by (encoder, version, prompt);
        ``compute(missing)`` encodes the prompts not cached yet (the generator adapter knows how)."""
        return self.cache.get_or_compute(encoder, self.versions[encoder], prompts, compute)


def freeze(model: nn.Module) -> nn.Module:
    """Eval mode, no gradients, zero dropout: a frozen component gives the same output for the same input."""
    model.eval()
    model.requires_grad_(False)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model
