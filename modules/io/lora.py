"""A LoRA adapter alone, in the two formats users load it in.

- ``diffusers``: ``pytorch_lora_weights.safetensors``, PEFT keys of the diffusers model
  (``transformer.blocks.0.attn1.to_q.lora_A.weight``, ...) and the adapter's ``LoraConfig`` in the file's metadata,
  written by the pipeline's own ``save_lora_weights``: what ``pipe.load_lora_weights(folder)`` reads.
- ``comfyui``: ``comfyui_lora.safetensors``, the original checkpoint's key names (Wan:
  ``diffusion_model.blocks.0.self_attn.q.lora_A.weight``; FLUX: ``diffusion_model.double_blocks.0.img_attn.qkv.
  lora_down.weight``) with ``.alpha`` where the readers take it: what ComfyUI and the model's own repository load,
  and what diffusers' ``load_lora_weights`` converts back itself. The names are each family's fact
  (``GeneratorAdapter.original_lora``, in ``modules/models/generators/<family>.py``); here they are applied.

``adapter.json`` beside them says what the adapter is: the card's expert, rank, alpha, target modules and the source
of the base weights it goes onto. The weights are bfloat16 unless asked otherwise (``.alpha`` stays float32: exact).
``posttrain export`` writes these files, and every checkpoint of a LoRA run holds them in ``adapter/``.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

import torch

from posttrain.modules.models.generators import ADAPTERS
from posttrain.modules.models.generators.base import OriginalLoraNames

FORMATS = ("diffusers", "comfyui")
FILES = {"diffusers": "pytorch_lora_weights.safetensors", "comfyui": "comfyui_lora.safetensors"}
INFO = "adapter.json"
FOLDER = "adapter"  # inside a checkpoint folder
BASE_KEYS = ("arch", "pretrained", "subfolder", "preset", "init_from")  # of a card's source: where the base comes from


@dataclass
class Adapter:
    """The LoRA adapter of one diffusers model, as trained.

    Args:
        expert: the card's component it belongs to (``transformer``, or an EMA copy ``transformer_ema``).
        arch: the model's architecture (which family names its layers).
        layers: PEFT keys relative to the model (``blocks.0.attn1.to_q.lora_A.weight``) -> weights.
        config: the adapter's peft ``LoraConfig`` as a dict (what diffusers rebuilds it from).
        base: where the base weights come from (a card's source: arch, pretrained, subfolder, preset).
        out_features: module name -> output width of every layer of the model (to fill a fused original layer's part
            the adapter does not train).
    """

    expert: str
    arch: str
    layers: dict[str, torch.Tensor]
    config: dict[str, Any]
    base: dict[str, Any] = field(default_factory=dict)
    out_features: dict[str, int] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    @property
    def alpha(self) -> float:
        return float(self.config["lora_alpha"])

    @property
    def scale(self) -> float:
        """What the adapter's output is multiplied by (peft: alpha / rank, or alpha / √rank with rsLoRA)."""
        return self.alpha / (self.rank ** 0.5 if self.config.get("use_rslora") else self.rank)

    @property
    def target_modules(self) -> list[str]:
        targets = self.config.get("target_modules") or []
        return [targets] if isinstance(targets, str) else sorted(targets)


def adapter_of(model: torch.nn.Module, expert: str, arch: str, base: Optional[Mapping[str, Any]] = None) -> Adapter:
    """The adapter ``model`` carries (peft's ``add_adapter``; its weights as they are now, not copied)."""
    from peft.utils import get_peft_model_state_dict

    configs = getattr(model, "peft_config", None) or {}
    if len(configs) != 1:
        raise ValueError(f"{expert!r} carries {len(configs)} LoRA adapters ({sorted(configs)}); one is expected")
    (config,) = configs.values()
    config = config.to_dict()
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{expert!r}: a LoRA with per-module ranks or alphas (rank_pattern, alpha_pattern) is not "
                         f"written as one file here")
    widths = {name: module.out_features for name, module in model.named_modules()
              if isinstance(getattr(module, "out_features", None), int)}
    return Adapter(expert=expert, arch=arch, layers=dict(get_peft_model_state_dict(model)), config=config,
                   base={k: v for k, v in (base or {}).items() if k in BASE_KEYS}, out_features=widths)


def formats_of(arch: str) -> tuple[str, ...]:
    """The formats an adapter of ``arch`` can be written in: ``comfyui`` where its family names the original layers."""
    family = ADAPTERS.get(arch)
    return FORMATS if family is not None and family.original_lora is not None else ("diffusers",)


def served(serving: Mapping[str, Any]) -> list[str]:
    """The transformers a run serves, from its ``serving_settings()`` (one per stage of a workflow)."""
    if serving.get("stages"):
        return [stage["transformer"] for stage in serving["stages"].values()]
    return [serving["transformer"]] if serving.get("transformer") else []


def card_adapters(card: Any, serving: Mapping[str, Any]) -> list[Adapter]:
    """The LoRA adapters of the generators a run serves (``served``): a LoRA expert's, or the one its EMA copy
    carries; none for a LoRA ``reference`` (the expert with its adapter off) or a full finetune."""
    sources = card.sources()
    found = []
    for name in served(serving):
        of, role = card.roles.get(name, (name, None))
        spec = card.specs.get(of)
        if spec is None or spec.lora is None or role == "reference" or spec.arch not in ADAPTERS:
            continue
        found.append(adapter_of(card.models[name], name, spec.arch, sources.get(of)))
    return found


def to_original(layers: Mapping[str, torch.Tensor], naming: OriginalLoraNames, scale: float,
                out_features: Optional[Mapping[str, int]] = None) -> dict[str, torch.Tensor]:
    """PEFT ``layers`` (``<module>.lora_A.weight`` (r, in), ``<module>.lora_B.weight`` (out, r); output scaled by
    ``scale``) under the original checkpoint's names ``naming``, in float32.

    Each module becomes ``<prefix><original>.<down>.weight`` = A and ``.<up>.weight`` = B, with
    ``<prefix><original>.alpha`` = scale · rank (a reader scales by alpha / rank), or, where the readers take no
    alpha, B · scale. An original layer that fuses k diffusers modules (FLUX's ``qkv``) gets the stacked adapter
    A = [A_1; …; A_k] (k·r, in) and the block-diagonal B = diag(B_1, …, B_k) (Σ out_i, k·r), so its output rows are
    each module's own B_i A_i x (a part not trained is zeros of its width, from ``out_features``); its alpha is
    scale · k·r. Raises ``ValueError`` naming the modules the family has no original name for.
    """
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in layers.items():
        module, _, kind = key.rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise ValueError(f"LoRA weight {key!r} has no original name: only lora_A / lora_B weights are written "
                             f"(no DoRA magnitudes, no LoRA biases)")
        pairs.setdefault(module, {})[kind[0]] = value.detach().to("cpu", torch.float32, copy=True)
    fused: dict[str, tuple[Any, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}
    unnamed = []
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA layer {module!r} has lora_{'A' if 'A' not in pair else 'B'} missing")
        for rule in naming.names:
            match = re.fullmatch(rule.diffusers, module)
            if match:
                original = match.expand(rule.original)
                fused.setdefault(original, (rule, {}))[1][rule.part] = (pair["A"], pair["B"])
                break
        else:
            unnamed.append(module)
    if unnamed:
        raise ValueError(f"the original checkpoint has no name known here for the LoRA layers {sorted(unnamed)[:4]}"
                         f"{f' (+{len(unnamed) - 4} more)' if len(unnamed) > 4 else ''}; train without them "
                         f"(lora.target_modules) or write the diffusers format alone")
    out: dict[str, torch.Tensor] = {}
    for original, (rule, parts) in sorted(fused.items()):
        if rule.parts == 1:
            A, B = parts[0]
        else:
            A, B = _fuse(original, rule, parts, naming, out_features or {})
        if rule.swap_halves:
            B = torch.cat(B.chunk(2, dim=0)[::-1], dim=0)
        key = f"{naming.prefix}{original}"
        if rule.alpha:
            out[f"{key}.alpha"] = torch.tensor(scale * A.shape[0], dtype=torch.float32)
        else:
            B = B * scale
        out[f"{key}.{naming.down}.weight"] = A
        out[f"{key}.{naming.up}.weight"] = B
    return out


def _fuse(original: str, rule, parts: dict[int, tuple[torch.Tensor, torch.Tensor]], naming: OriginalLoraNames,
          out_features: Mapping[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[A_1; …; A_k] and diag(B_1, …, B_k) of one fused original layer; a part not trained is zeros."""
    rank, width = next(iter(parts.values()))[0].shape
    As, Bs = [], []
    for i in range(rule.parts):
        if i in parts:
            A, B = parts[i]
        else:
            out = _part_width(original, i, naming, out_features)
            A, B = torch.zeros(rank, width), torch.zeros(out, rank)
        As.append(A)
        Bs.append(B)
    return torch.cat(As, dim=0), torch.block_diag(*Bs)


def _part_width(original: str, part: int, naming: OriginalLoraNames, out_features: Mapping[str, int]) -> int:
    for rule in naming.names:
        if rule.part != part:
            continue
        for module, width in out_features.items():
            match = re.fullmatch(rule.diffusers, module)
            if match and match.expand(rule.original) == original:
                return width
    raise ValueError(f"{original!r} fuses layers the adapter trains only in part; the width of part {part} is unknown "
                     f"(pass the model's out_features)")


@dataclass
class Prepared:
    """An adapter's files, computed (cast, renamed) and ready to write: ``write`` only serializes."""

    adapter: Adapter
    tensors: dict[str, dict[str, torch.Tensor]]  # format -> what its file holds
    info: dict[str, Any]

    def write(self, folder: str) -> list[str]:
        """Write the files into ``folder`` (made if needed); returns their paths."""
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        written = []
        if "diffusers" in self.tensors:  # the pipeline's own writer: PEFT keys under `transformer.`, LoraConfig metadata
            ADAPTERS[self.adapter.arch].pipeline_class().save_lora_weights(
                folder, transformer_lora_layers=self.tensors["diffusers"], safe_serialization=True,
                transformer_lora_adapter_metadata=_json_ready(self.adapter.config))
            written.append(os.path.join(folder, FILES["diffusers"]))
        if "comfyui" in self.tensors:
            path = os.path.join(folder, FILES["comfyui"])
            save_file(self.tensors["comfyui"], path, metadata={"format": "pt"})
            written.append(path)
        path = os.path.join(folder, INFO)
        with open(path, "w") as f:
            json.dump(self.info, f, indent=1)
        return written + [path]


def prepare(adapter: Adapter, formats: Iterable[str] = FORMATS, dtype: torch.dtype = torch.bfloat16) -> Prepared:
    """``adapter``'s files in ``formats`` (``diffusers``, ``comfyui``), weights in ``dtype``, copied off the model:
    every problem (a layer without an original name) is raised here, before anything is written."""
    formats = list(dict.fromkeys(formats))
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise ValueError(f"LoRA formats {formats}: each is one of {list(FORMATS)}")
    family = ADAPTERS.get(adapter.arch)
    if family is None:
        raise ValueError(f"{adapter.expert!r} ({adapter.arch}) is not a generator; its LoRA has no diffusers file")
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    if "diffusers" in formats:
        tensors["diffusers"] = {k: v.detach().to("cpu", dtype, copy=True).contiguous()
                                for k, v in adapter.layers.items()}
    if "comfyui" in formats:
        if family.original_lora is None:
            raise ValueError(f"{adapter.arch} declares no original LoRA key names (GeneratorAdapter.original_lora): "
                             f"write the diffusers format (--format diffusers)")
        original = to_original(adapter.layers, family.original_lora, adapter.scale, adapter.out_features)
        tensors["comfyui"] = {k: (v if k.endswith(".alpha") else v.to(dtype)).contiguous()
                              for k, v in original.items()}
    parameters = sum(v.numel() for v in adapter.layers.values())
    info = {"expert": adapter.expert, "arch": adapter.arch, "pipeline": family.pipeline_class().__name__,
            "rank": adapter.rank, "alpha": adapter.alpha, "target_modules": adapter.target_modules,
            "use_rslora": bool(adapter.config.get("use_rslora")), "parameters": parameters,
            "dtype": str(dtype).removeprefix("torch."), "base": adapter.base,
            "files": {f: FILES[f] for f in formats}}
    return Prepared(adapter, tensors, info)


def write(folder: str, adapter: Adapter, formats: Iterable[str] = FORMATS,
          dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """``prepare`` then ``Prepared.write``: the adapter's files in ``folder``."""
    return prepare(adapter, formats, dtype).write(folder)


def _json_ready(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the LoraConfig dict for the file's metadata (JSON: sets as sorted lists)."""
    return {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in config.items()}
