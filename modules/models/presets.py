"""Real model classes, as tiny random-weight presets or loaded with ``from_pretrained``: the one recipe every
model of the package is built by.

Every component of a card is built here from its ``arch`` name: an ``Architecture`` of ``ARCHITECTURES``, the
shared components below (text encoders, the image encoder, the refiner LM) and those every generator family declares
in its own file (``modules/models/generators/<family>.py``: the generator, its preset and adapter, its VAE and
codec). A preset is the constructor
config of the real ``diffusers``/``transformers`` class, shrunk so that the embedded default trains on a CPU in
seconds; ``preset`` overrides in YAML change single keys of it. With ``pretrained`` set, the class's own
``from_pretrained`` loads a local folder (or a hub id already in the local cache): nothing is downloaded at run
time.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Callable, Container, Iterable, Iterator, Literal, Mapping, Optional, Union

import torch
from diffusers import ModelMixin
from transformers import (
    AutoTokenizer,
    ByT5Tokenizer,
    CLIPTextModel,
    CLIPVisionModel,
    Qwen2ForCausalLM,
    T5EncoderModel,
    UMT5EncoderModel,
)

from posttrain.modules.models import fp8 as float8
from posttrain.modules.models.generators import ARCHITECTURES as _FAMILIES
from posttrain.modules.models.generators.base import BYT5_VOCAB, TEXT_DIM, Architecture, TrainingForward

__all__ = ["ARCHITECTURES", "Arch", "PRESETS", "TRAINED_ASSETS", "BYT5_VOCAB", "TEXT_DIM", "architecture", "archs",
           "causal", "build_model", "build_skeleton", "add_lora", "cast", "tokenizer_of"]


def _lm_inputs(config: dict, forward: TrainingForward) -> dict[str, tuple]:
    return {"input_ids": (forward.rows, forward.text_length)}


# The components every generator family may read (each family's own generator and VAE are in its file).
_SHARED: dict[str, Architecture] = {
    # Wan's text encoder; the shipped asset was trained jointly with the world's Wan generator (scripts/train_world.py)
    "umt5": Architecture(UMT5EncoderModel, dict(
        vocab_size=BYT5_VOCAB, d_model=TEXT_DIM, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
        dropout_rate=0.0, relative_attention_num_buckets=8,
    ), "text_encoder", asset=True),
    # FLUX's (and SD3's) token encoder; the shipped asset was trained jointly with CLIP and FLUX (scripts/train_flux.py)
    "t5": Architecture(T5EncoderModel, dict(
        vocab_size=BYT5_VOCAB, d_model=TEXT_DIM, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
        dropout_rate=0.0, relative_attention_num_buckets=8,
    ), "text_encoder", asset=True),
    # FLUX's pooled text encoder (``CLIPTextModel.pooler_output``: the final hidden state at the first eos).
    # ByT5 ids (eos 1, pad 0); ``max_position_embeddings`` is the tokenizer's ``model_max_length``, which
    # FluxPipeline pads every prompt to.
    "clip": Architecture(CLIPTextModel, dict(
        vocab_size=BYT5_VOCAB, hidden_size=TEXT_DIM, intermediate_size=64, projection_dim=TEXT_DIM,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=1,
    ), "text_encoder", asset=True, tokenizer_length_key="max_position_embeddings"),
    # Wan 2.1 I2V's image encoder (``CLIPVisionModel``; the pipeline reads its penultimate hidden states).
    "clip_vision": Architecture(CLIPVisionModel, dict(
        hidden_size=32, intermediate_size=64, projection_dim=32, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, patch_size=8,
    ), "image_encoder"),
    "qwen2": Architecture(Qwen2ForCausalLM, dict(
        vocab_size=BYT5_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        attention_dropout=0.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=1,
        pad_token_id=0,
    ), "lm", layer_keys=("num_hidden_layers",), inputs=_lm_inputs),
}


def _registry(*parts: dict[str, Architecture]) -> dict[str, Architecture]:
    merged: dict[str, Architecture] = {}
    for part in parts:
        clash = sorted(set(merged) & set(part))
        if clash:
            raise ValueError(f"arch {clash} is declared twice (modules/models/presets.py and modules/models/generators/)")
        merged.update(part)
    return merged


ARCHITECTURES: dict[str, Architecture] = _registry(_SHARED, _FAMILIES)
Arch = Literal[tuple(ARCHITECTURES)]  # the `arch:` values a card accepts
PRESETS: dict[str, dict[str, Any]] = {name: arch.preset for name, arch in ARCHITECTURES.items()}
TEXT_ENCODERS = tuple(name for name, arch in ARCHITECTURES.items() if arch.kind == "text_encoder")
DIFFUSERS_ARCHS = tuple(name for name, arch in ARCHITECTURES.items() if issubclass(arch.cls, ModelMixin))
# Presets that carry trained weights, made here from the synthetic data (no download) by the scripts named at each
# entry, and loaded through ``from_pretrained`` like any local checkpoint.
_ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")  # modules/assets
TRAINED_ASSETS = {name: os.path.join(_ASSETS, arch.asset if isinstance(arch.asset, str) else name)
                  for name, arch in ARCHITECTURES.items() if arch.asset}
# The world's pretrained refiner (scripts/train_refiner.py): a ``qwen2`` (Qwen2ForCausalLM, ByT5 bytes) that rewrites a
# user request into the caption the generator reads. Not a preset's default (a plain ``arch: qwen2`` stays the random
# tiny LM); a card names it as ``{arch: qwen2, pretrained: modules/assets/refiner}`` (from the repository root).
REFINER_ASSET = os.path.join(_ASSETS, "refiner")


def architecture(arch: str) -> Architecture:
    """The ``Architecture`` named ``arch``; an unknown name is an error that lists the known ones."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[arch]


def archs(kind: str) -> list[str]:
    """The architecture names of one ``kind`` (``generator``, ``vae``, ``text_encoder``, ``image_encoder``, ``lm``)."""
    return [name for name, arch in ARCHITECTURES.items() if arch.kind == kind]


def causal(arch: str) -> bool:
    """Whether ``arch`` is a block-causal generator (samples chunk by chunk through a KV cache)."""
    return arch in ARCHITECTURES and ARCHITECTURES[arch].causal


def model_class(arch: str) -> type[torch.nn.Module]:
    return architecture(arch).cls


def check_pretrained(pretrained: str) -> str | None:
    """The problem with a ``pretrained`` value, or None. A hub id must already be in the local cache."""
    if os.path.isdir(pretrained):
        return None
    if os.path.exists(pretrained) or pretrained.startswith((".", "/", "~")) or pretrained.count("/") != 1:
        return f"pretrained path {pretrained!r} is not a folder"
    return None  # "org/name": resolved from the local Hugging Face cache at build time


def loads_weights(arch: str, pretrained: str | None = None, preset: dict[str, Any] | None = None) -> bool:
    """Whether ``build_model`` reads stored weights (``pretrained``, or the shipped asset of a preset without
    overrides) rather than building random ones from a config."""
    return pretrained is not None or (arch in TRAINED_ASSETS and not preset)


def build_model(arch: str, pretrained: str | None = None, subfolder: str | None = None,
                preset: dict[str, Any] | None = None, dtype: torch.dtype | None = None, *,
                weights: Union[Literal["stored", "init"], Mapping[str, torch.Tensor]] = "stored",
                config: Optional[Mapping[str, Any]] = None, lora: Any = None,
                device: Optional[str] = None, published: Optional[str] = None, fp8: bool = False) -> torch.nn.Module:
    """One real model of ``arch``: the one recipe every model of the package is built by (a card's experts, a
    ZeRO-3 expert's partitioned build, ``posttrain estimate``'s meta models, ``posttrain export``'s rebuild).

    Its config is ``config`` (a checkpoint's) when given; else, with ``published`` (a name of
    ``modules/models/published.py``), that published model's component (``subfolder``, or the one of ``arch``) with
    the ``preset`` overrides, its weights random from a fixed seed (``published.materialize``); else that of the folder
    holding its stored weights (``pretrained`` + ``subfolder``, or the shipped asset of a preset without overrides);
    else the tiny preset with the ``preset`` overrides.

    Args:
        weights: ``"stored"``: the folder's weights (``from_pretrained``), random ones for a preset; ``"init"``: as
            the constructor initialises them, for a caller that fills them itself (``load_weights``; under
            ``deepspeed.zero.Init`` each process then allocates only its partition); a state dict: loaded after
            the LoRA adapter, every key matched.
        dtype: the floating-point weights in ``dtype`` but for the modules the class keeps in float32 (``cast``).
        lora: attach this LoRA adapter (``rank``, ``alpha``, ``target_modules``: a mapping or an object with
            those attributes; ``add_lora``).
        device: ``"meta"``: nothing is read or allocated (shapes and dtypes only).
        fp8: the Linear layers of its blocks stored in float8, computed in ``dtype`` (``modules/models/fp8.py``),
            before any LoRA adapter; stored weights stream in block by block (``_streamed``), a published model's are
            drawn block by block (``fp8.materialize``), so no full-precision copy is held. Not on ``"meta"``.
    """
    spec = architecture(arch)
    if fp8 and (weights != "stored" or device is not None):
        what = weights if isinstance(weights, str) else "a state dict"
        raise ValueError(f"fp8 quantizes the weights the build fills itself, not weights={what!r} on "
                         f"device={device!r}: build without fp8 and call fp8.quantize once the weights are in")
    if published is not None and config is None:
        from posttrain.modules.models import published as catalog

        config = _merged(spec, catalog.config(published, arch, subfolder), preset)
        if weights == "stored" and device is None:  # real size: built on meta, filled module by module
            with catalog.empty_weights():
                model = cast(_from_config(spec.cls, config, preset=True), dtype)
            seed = catalog.seed_of(published, arch, subfolder)
            if fp8:  # each block stored in float8 as soon as it is filled
                model = float8.materialize(model, lambda view: catalog.materialize(view, seed))
            else:
                model = catalog.materialize(model, seed)
            return add_lora(model, lora) if lora is not None else model
    with torch.device(device) if device is not None else contextlib.nullcontext():
        if weights == "stored" and config is None and device is None and loads_weights(arch, pretrained, preset):
            model = _streamed(arch, pretrained, subfolder, dtype) if fp8 else _from_pretrained(arch, pretrained,
                                                                                                subfolder, dtype)
        else:
            if config is not None:
                model = _from_config(spec.cls, {k: v for k, v in config.items() if not k.startswith("_")})
            elif loads_weights(arch, pretrained, preset):
                model = _from_config(spec.cls, _folder_config(arch, pretrained, subfolder))
            else:
                model = _from_config(spec.cls, _merged(spec, spec.preset, preset), preset=True)
            model = cast(model, dtype)
            if fp8:
                float8.quantize(model)
        if lora is not None:
            add_lora(model, lora)
    if isinstance(weights, Mapping):
        missing, unexpected = model.load_state_dict(dict(weights), strict=False)
        if missing or unexpected:
            raise ValueError(f"the weights do not fit its class {spec.cls.__name__}: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
    return model


def _foreign_asset(cls: type, folder: str) -> torch.nn.Module:
    """A diffusers ``cls`` from the asset ``folder`` of another architecture (of this class or another) whose weights it
    loads key for key: its config is what ``cls`` reads of the folder's (another class's own keys left out, so a saved
    or exported copy carries none of them), and every stored tensor fills one of its weights."""
    from safetensors.torch import load_file

    init, _, _ = cls.extract_init_dict(cls.load_config(folder))
    model = _from_config(cls, init)
    model.load_state_dict(load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors")), strict=True)
    return model


def _merged(spec: Architecture, base: Mapping[str, Any], preset: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """The constructor config ``base`` (the tiny preset, a published component's) with the ``preset`` overrides; a
    VAE's config then follows its layers (its codec: Wan's scale factors)."""
    merged = {**base, **(preset or {})}
    if spec.codec is not None:
        merged = spec.codec.preset(merged, dict(preset or {}))
    return merged


def _from_pretrained(arch: str, pretrained: str | None, subfolder: str | None,
                     dtype: torch.dtype | None) -> torch.nn.Module:
    """``from_pretrained`` of ``pretrained`` (+ ``subfolder``), or of the shipped asset when ``pretrained`` is None."""
    cls = model_class(arch)
    if pretrained is None:
        # another architecture's folder: the world's Wan VAE as Qwen-Image's, TI2V's transformer as its i2v arch's
        if isinstance(architecture(arch).asset, str):
            return cast(_foreign_asset(cls, TRAINED_ASSETS[arch]), dtype)
        with _no_progress_bar():  # a shipped tiny asset loads in milliseconds; transformers would draw a bar
            return cast(cls.from_pretrained(TRAINED_ASSETS[arch], local_files_only=True), dtype)
    kwargs: dict[str, Any] = {"local_files_only": not os.path.isdir(pretrained)}
    if subfolder:
        kwargs["subfolder"] = subfolder
    if dtype not in (None, torch.float32):
        kwargs["torch_dtype"] = dtype
    _check_class(arch, pretrained, subfolder)
    try:
        return cls.from_pretrained(pretrained, **kwargs)
    except (OSError, ValueError, TypeError, RuntimeError) as err:
        raise ValueError(
            f"could not load {arch!r} from pretrained={pretrained!r}"
            f"{f' (subfolder {subfolder!r})' if subfolder else ''}: {err}. Give a local folder in the "
            f"layout `save_pretrained` writes, or drop `pretrained` to use the tiny preset."
        ) from err


@torch.no_grad()
def _streamed(arch: str, pretrained: str | None, subfolder: str | None, dtype: torch.dtype | None) -> torch.nn.Module:
    """The folder's weights with the Linear layers of each block in float8: built on the meta device from the
    folder's config (``build_skeleton`` under ``published.empty_weights``), then filled from its safetensors
    (``weight_files``: one, or the shards its index lists) one file and one tensor at a time: each tensor is read
    and converted to its parameter's dtype, and each block is quantized as soon as its last tensor has arrived.
    Host memory peaks at the final model plus a tensor and the blocks still filling (save_pretrained writes blocks
    in order, so about one), whatever the files' precision.

    A parameter shared by two modules (tied embeddings) is filled once under either name; a parameter the files
    lack stops with its name before anything is read; tensors of the files the model has no place for are
    ignored, as ``load_weights`` does."""
    from safetensors import safe_open

    from posttrain.modules.models import published as catalog

    with catalog.empty_weights():  # buffers real: rotary tables are computed from the config
        model = build_skeleton(arch, pretrained, subfolder, dtype)
    folder = weights_folder(arch, pretrained, subfolder)
    files = weight_files(folder)
    float8.tie(model)
    stored: list[str] = []  # the files' tensor names
    for file in files:
        with safe_open(file, framework="pt") as handle:
            stored += handle.keys()
    renamed = {key: name for name, key in checkpoint_names(model, stored).items()}  # file's name -> the model's
    params = {id(param): param for param in model.parameters()}
    names, source = _tensor_sources(model, set(renamed.values()), folder, needed=lambda param: param.is_meta)
    units = float8.units(model)
    pending: dict[str, int] = {}  # unit -> its parameters still to read
    by_key: dict[str, int] = {}
    for pid, key in source.items():
        if key is not None and params[pid].is_meta:
            by_key[key] = pid
            unit = float8.unit_of(names[pid][0], units)
            pending[unit] = pending.get(unit, 0) + 1
    buffers = dict(model.named_buffers())
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for stored_key in handle.keys():
                key = renamed.get(stored_key, stored_key)
                if key in by_key:
                    pid = by_key[key]
                    old = params[pid]
                    # copy=True: a tensor read from the file is a view of the file's whole memory map; one kept
                    # (already in its dtype) would keep every page of the shard read so far resident
                    value = handle.get_tensor(stored_key).to(dtype=old.dtype, copy=True).view(old.shape)
                    new = torch.nn.Parameter(value, requires_grad=old.requires_grad)
                    for name in names[pid]:
                        owner, _, attr = name.rpartition(".")
                        model.get_submodule(owner)._parameters[attr] = new
                    unit = float8.unit_of(names[pid][0], units)
                    pending[unit] -= 1
                    if unit and pending[unit] == 0:
                        float8.quantize(model, only=unit)
                        float8.give_back_freed_memory()
                elif key in buffers:
                    buffers[key].copy_(handle.get_tensor(stored_key))  # copied into the buffer's own memory
    return model


def _check_class(arch: str, pretrained: str, subfolder: str | None) -> None:
    """A diffusers folder names its class: one that is not ``arch``'s is refused naming both (transformers folders
    may name a wider class, which loads)."""
    expected = model_class(arch).__name__
    config_file = os.path.join(pretrained, subfolder or "", "config.json")
    if os.path.isfile(config_file):
        with open(config_file, encoding="utf-8") as f:
            found = json.load(f).get("_class_name")
        if found and found != expected:
            raise ValueError(f"pretrained={pretrained!r}{f' (subfolder {subfolder!r})' if subfolder else ''} holds "
                             f"a {found}, but arch {arch!r} is a {expected}: point `pretrained` (and `subfolder`) "
                             f"at the {expected} folder")


def _folder_config(arch: str, pretrained: str | None, subfolder: str | None):
    """The config of the folder ``build_model`` reads ``arch``'s stored weights from (no weight is read)."""
    folder = weights_folder(arch, pretrained, subfolder)
    if pretrained is not None:
        _check_class(arch, pretrained, subfolder)
    cls = model_class(arch)
    if issubclass(cls, ModelMixin):
        return cls.load_config(folder)
    return cls.config_class.from_pretrained(folder)


def _from_config(cls: type, config, preset: bool = False) -> torch.nn.Module:
    """``cls`` built from a config (a dict, or a transformers config object): a preset's keys are the constructor's
    own; a saved config (a folder's, a checkpoint's) goes through the class's ``from_config``/``from_dict``."""
    if issubclass(cls, ModelMixin):
        return cls(**config) if preset else cls.from_config(config)
    if isinstance(config, Mapping):
        config = cls.config_class(**config) if preset else cls.config_class.from_dict(dict(config))
    return cls(config)


def add_lora(model: torch.nn.Module, lora: Any) -> torch.nn.Module:
    """Attach a peft LoRA adapter to ``model`` (``lora``: ``rank``, ``alpha``, ``target_modules`` as a mapping or
    attributes), its base weights frozen: the one place the package attaches one. The adapter's weights are float32
    whatever the base's dtype (peft's ``cast_adapter_dtype``, what its ``get_peft_model`` does): a bf16 or fp8 base
    computes in bf16, the adapter and its optimizer state keep full precision."""
    from peft import LoraConfig as PeftLoraConfig
    from peft.tuners.tuners_utils import cast_adapter_dtype

    get = lora.get if isinstance(lora, Mapping) else lambda key: getattr(lora, key)
    model.requires_grad_(False)
    model.add_adapter(PeftLoraConfig(r=get("rank"), lora_alpha=get("alpha"), target_modules=list(get("target_modules")),
                                     init_lora_weights=True))
    cast_adapter_dtype(model, adapter_name="default")
    return model


def base_keys(model: torch.nn.Module, trains: Optional[torch.nn.Module] = None) -> set[str]:
    """The state-dict keys of ``model``'s base, what its source builds and a checkpoint may leave out: every entry
    but a LoRA adapter's layers (peft's ``LoraLayer.adapter_layer_names``) and the parameters that train in ``trains``
    (``model`` itself unless given: a role's frozen copy names its expert)."""
    from peft.tuners.lora import LoraLayer

    adapter = set(LoraLayer.adapter_layer_names)
    trained = {key for key, param in (trains or model).named_parameters() if param.requires_grad}
    return {key for key in model.state_dict() if key not in trained and adapter.isdisjoint(key.split("."))}


def load_onto_base(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """Load ``state`` into ``model``, built with its base from its source (a LoRA expert): the base's keys
    (``base_keys``) may be missing, the model keeps its own; any other missing key, or an unexpected one, is
    refused (ValueError) and nothing is loaded."""
    expected, base = set(model.state_dict()), base_keys(model)
    missing = sorted(key for key in expected if key not in state and key not in base)
    unexpected = sorted(key for key in state if key not in expected)
    if missing or unexpected:
        raise ValueError(f"the weights do not fit the model its source builds: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}")
    model.load_state_dict(dict(state), strict=False)
    return model


def weights_folder(arch: str, pretrained: str | None = None, subfolder: str | None = None) -> str:
    """The local folder ``build_model`` reads stored weights from (``pretrained`` + ``subfolder``, or the
    shipped asset), for an expert where ``loads_weights`` holds."""
    if pretrained is None:
        return TRAINED_ASSETS[arch]
    if not os.path.isdir(pretrained):
        from huggingface_hub import snapshot_download

        pretrained = snapshot_download(pretrained, local_files_only=True)  # "org/name" from the local cache
    return os.path.join(pretrained, subfolder or "")


def build_skeleton(arch: str, pretrained: str | None = None, subfolder: str | None = None,
                   dtype: torch.dtype | None = None) -> torch.nn.Module:
    """``build_model(..., weights="init")``: the model of a weights folder built from its config alone, for a caller
    that fills the weights itself (``load_weights``)."""
    return build_model(arch, pretrained, subfolder, dtype=dtype, weights="init")


def weight_files(folder: str) -> list[str]:
    """The safetensors files of a ``save_pretrained`` folder, one or the shards its index lists."""
    for stem in ("diffusion_pytorch_model", "model"):
        index = os.path.join(folder, f"{stem}.safetensors.index.json")
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return [os.path.join(folder, shard) for shard in shards]
        single = os.path.join(folder, f"{stem}.safetensors")
        if os.path.isfile(single):
            return [single]
    raise ValueError(f"{folder!r} has no safetensors weights (diffusion_pytorch_model.safetensors or "
                     f"model.safetensors, single or sharded with an index); a ZeRO-3 expert reads its stored weights "
                     f"shard by shard from safetensors: re-save the model with save_pretrained(folder)")


@torch.no_grad()
def load_weights(model: torch.nn.Module, folder: str,
                 gather: Callable[[list[torch.nn.Parameter]], contextlib.AbstractContextManager],
                 reads: bool = True) -> None:
    """Fill ``model`` (built by ``build_skeleton``, possibly partitioned) with the weights in ``folder``, one
    module at a time: ``gather(params)`` makes that module's parameters whole for the duration (for ZeRO-3
    ``deepspeed.zero.GatheredParameters(params, modifier_rank=0)``, which re-partitions what rank 0 wrote),
    so no process ever holds more than one module's full weights. Only a process with ``reads`` reads the
    parameters (the others receive them); buffers are read everywhere. A tied parameter is found under any
    of its names; a parameter the files lack stops with its name."""
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:  # each file opened once (memory-mapped), tensors read as needed
        handles = [stack.enter_context(safe_open(file, framework="pt")) for file in weight_files(folder)]
        stored = {key: handle for handle in handles for key in handle.keys()}
        # the model's name of each stored tensor -> (its name in the files, the file)
        where = {name: (key, stored[key]) for name, key in checkpoint_names(model, stored).items()}
        # a missing weight is decided on every process from the file listing, before any collective
        _, key = _tensor_sources(model, where, folder)

        def read(name: str) -> torch.Tensor:
            stored_key, handle = where[name]
            return handle.get_tensor(stored_key)

        for prefix, module in model.named_modules():
            params = list(module.parameters(recurse=False))
            if params:
                with gather(params):
                    if reads:
                        for param in params:
                            param.data.copy_(read(key[id(param)]).view_as(param.data))
            for name, buffer in module.named_buffers(recurse=False):
                name = f"{prefix}.{name}" if prefix else name
                if name in where:
                    buffer.copy_(read(name))


def checkpoint_names(model: torch.nn.Module, stored: Iterable[str]) -> dict[str, str]:
    """The model's name of each tensor name ``stored`` in a weights folder -> that stored name: the same for a
    diffusers model; for a transformers model the name transformers' own loading gives it (its conversion mapping's
    renamings: a checkpoint of an older layout, e.g. Qwen2.5-VL's ``model.layers.*``, which transformers 5 holds as
    ``model.language_model.layers.*``, as the hub's Qwen-Image ``text_encoder`` is saved). Tensors that transformers
    would fuse or split (its converters) keep their names: a streamed load reads one tensor into one parameter."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return {key: key for key in stored}
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    own = model.state_dict(keep_vars=True)  # names only (a skeleton's tensors may be on the meta device)
    names: dict[str, str] = {}
    for key in stored:
        names.setdefault(rename_source_key(key, renamings, [], model.base_model_prefix, own)[0], key)
    return names


def _tensor_sources(model: torch.nn.Module, keys: Container[str], folder: str,
                    needed: Callable[[torch.nn.Parameter], bool] = lambda param: True
                    ) -> tuple[dict[int, list[str]], dict[int, Optional[str]]]:
    """Where the tensors of a weights folder (``keys``: their names) hold ``model``'s parameters: every name of each
    parameter by its id (a tied one has several) and the first of them ``keys`` holds (None: none). A ``needed``
    parameter the files lack stops with its name, before anything is read."""
    names: dict[int, list[str]] = {}
    params: dict[int, torch.nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        params[id(param)] = param
    source = {pid: next((n for n in candidates if n in keys), None) for pid, candidates in names.items()}
    missing = [names[pid][0] for pid, key in source.items() if key is None and needed(params[pid])]
    if missing:
        raise ValueError(f"{folder!r} lacks {len(missing)} weight(s) of the {type(model).__name__} its config builds, "
                         f"e.g. {missing[:3]}: point `pretrained` at a folder save_pretrained wrote for this class")
    return names, source


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def cast(model: torch.nn.Module, dtype: torch.dtype | None) -> torch.nn.Module:
    """``model``'s floating-point weights in ``dtype``, except those its class keeps in float32
    (``_keep_in_fp32_modules``: Wan's time embedder, norms and modulation tables, T5's ``wo``), as
    ``from_pretrained(torch_dtype=...)`` does."""
    if dtype is None:
        return model
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or []) if dtype != torch.float32 else set()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(torch.float32 if keep.intersection(name.split(".")) else dtype)
    return model


def build_tokenizer(path: str | None = None, model_max_length: int | None = None):
    """``ByT5Tokenizer()`` needs no vocabulary file; a real text encoder names its own tokenizer folder.
    ``model_max_length`` is what pipelines that pad to the tokenizer's length read (FluxPipeline's CLIP)."""
    if path is not None:
        return AutoTokenizer.from_pretrained(path, local_files_only=not os.path.isdir(path))
    if model_max_length is not None:
        return ByT5Tokenizer(model_max_length=model_max_length)
    return ByT5Tokenizer()


def config_dict(config: Any) -> dict:
    """A model's config as a plain dict: a diffusers ``FrozenDict`` as it is, a transformers config by ``to_dict``."""
    return dict(config) if isinstance(config, dict) else config.to_dict()


def tokenizer_length(arch: str, config: Any) -> int | None:
    """The ``model_max_length`` a tokenizer built for ``arch`` needs (CLIP pads to its position table), or None."""
    key = architecture(arch).tokenizer_length_key
    if key is None:
        return None
    return int(config_dict(config)[key])


def tokenizer_of(arch: str, path: str | None, config: Any):
    """The tokenizer of a text encoder or LM of ``arch`` (``path``: its own folder; None: ``ByT5Tokenizer``) whose
    model has ``config``; None for an architecture that reads no text."""
    if not architecture(arch).tokenized:
        return None
    return build_tokenizer(path, tokenizer_length(arch, config))
