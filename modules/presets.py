"""Real model classes, as tiny random-weight presets or loaded with ``from_pretrained``.

Every component of a card is built here from its ``arch`` name. A preset is the constructor config of
the real ``diffusers``/``transformers`` class, shrunk so that the embedded default trains on a CPU in
seconds; ``preset`` overrides in YAML change single keys of it. With ``pretrained`` set, the class's
own ``from_pretrained`` loads a local folder (or a hub id already in the local cache): nothing is
downloaded at run time.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Callable, Iterator, Literal

import torch
from diffusers import AutoencoderKL, AutoencoderKLWan, FluxTransformer2DModel, WanTransformer3DModel
from transformers import (
    AutoTokenizer,
    ByT5Tokenizer,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPVisionConfig,
    CLIPVisionModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    T5Config,
    T5EncoderModel,
    UMT5Config,
    UMT5EncoderModel,
)

from posttrain.modules.causal_wan import CausalWanTransformer3DModel

Arch = Literal["wan_t2v", "wan_t2v_causal", "wan_i2v", "wan_vae", "umt5", "t5", "clip", "clip_vision", "qwen2", "flux",
               "vae_kl"]

# ByT5 ids are byte + 3 (pad 0, eos 1, unk 2) plus 125 extra ids: 384 in all. Every tiny text model
# uses this vocabulary so that ``ByT5Tokenizer()`` (no vocabulary file) serves all of them.
BYT5_VOCAB = 384
TEXT_DIM = 32

PRESETS: dict[str, dict[str, Any]] = {
    # WanTransformer3DModel, 1.2M parameters; patch (1,2,2) on the 4x VAE's latents: a 5x32x32 video is
    # 2x4x4 = 32 tokens. text_dim matches the UMT5's d_model. Without overrides it loads
    # TRAINED_ASSETS["wan_t2v"] (scripts/train_world.py), trained jointly with that UMT5.
    "wan_t2v": dict(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=16,
        out_channels=16, text_dim=TEXT_DIM, freq_dim=64, ffn_dim=512, num_layers=4,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    ),
    # The block-causal student (CausalWanTransformer3DModel, Self-Forcing): Wan T2V's config and state dict
    # (``init_from: teacher`` copies the pretrained world's generator into it).
    "wan_t2v_causal": dict(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=16,
        out_channels=16, text_dim=TEXT_DIM, freq_dim=64, ffn_dim=512, num_layers=4,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    ),
    # Wan 2.2-style image-to-video (``WanImageToVideoPipeline`` without an image encoder): noisy latent (16)
    # + first-frame mask (4, the VAE's temporal factor) + image latents (16) channels in. The Wan 2.1 layout
    # adds ``image_dim`` and ``added_kv_proj_dim`` (a CLIP vision encoder's tokens; see ``clip_vision``).
    # The world's I2V generator has the world's T2V dimensions (1.2M parameters; it starts from its weights).
    "wan_i2v": dict(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=36,
        out_channels=16, text_dim=TEXT_DIM, freq_dim=64, ffn_dim=512, num_layers=4,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    ),
    # AutoencoderKLWan: 4x spatial (three levels), 4x temporal ((F-1)/4+1 latent frames), 16 latent
    # channels, encoder and decoder of width 16 (0.13M parameters). Without overrides it loads
    # TRAINED_ASSETS["wan_vae"] (scripts/train_vae.py), which is exactly this architecture.
    "wan_vae": dict(
        base_dim=16, z_dim=16, dim_mult=[1, 1, 1], num_res_blocks=0, temperal_downsample=[True, True],
        scale_factor_spatial=4, scale_factor_temporal=4,
    ),
    "umt5": dict(
        vocab_size=BYT5_VOCAB, d_model=TEXT_DIM, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
        dropout_rate=0.0, relative_attention_num_buckets=8,
    ),
    "t5": dict(
        vocab_size=BYT5_VOCAB, d_model=TEXT_DIM, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
        dropout_rate=0.0, relative_attention_num_buckets=8,
    ),
    # FLUX's pooled text encoder (``CLIPTextModel.pooler_output``: the final hidden state at the first eos).
    # ByT5 ids (eos 1, pad 0); ``max_position_embeddings`` is the tokenizer's ``model_max_length``, which
    # FluxPipeline pads every prompt to.
    "clip": dict(
        vocab_size=BYT5_VOCAB, hidden_size=TEXT_DIM, intermediate_size=64, projection_dim=TEXT_DIM,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=1,
    ),
    # Wan 2.1 I2V's image encoder (``CLIPVisionModel``; the pipeline reads its penultimate hidden states).
    "clip_vision": dict(
        hidden_size=32, intermediate_size=64, projection_dim=32, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, patch_size=8,
    ),
    "qwen2": dict(
        vocab_size=BYT5_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        attention_dropout=0.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=1,
        pad_token_id=0,
    ),
    # FLUX text-to-image, 0.47M parameters: 2×2 packed latents of the 16-channel VAE in (64), T5 tokens
    # (joint_attention_dim) and CLIP's pooled vector (pooled_projection_dim) as text; RoPE axes sum to the
    # head dim. A 32 px image is 8×8 latents, 16 tokens.
    "flux": dict(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=32,
        num_attention_heads=2, joint_attention_dim=TEXT_DIM, pooled_projection_dim=TEXT_DIM,
        axes_dims_rope=(8, 12, 12),
    ),
    # AutoencoderKL for FLUX: 4x spatial (three levels; FluxPipeline reads 2^(levels-1) from the config),
    # 16 latent channels; normalized by (z - shift_factor)·scaling_factor.
    "vae_kl": dict(
        block_out_channels=(16, 32, 32), latent_channels=16, norm_num_groups=8, layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        shift_factor=0.0, scaling_factor=1.0,
    ),
}

_DIFFUSERS = {
    "wan_t2v": WanTransformer3DModel, "wan_t2v_causal": CausalWanTransformer3DModel, "wan_i2v": WanTransformer3DModel,
    "wan_vae": AutoencoderKLWan, "flux": FluxTransformer2DModel, "vae_kl": AutoencoderKL,
}
_TRANSFORMERS = {
    "umt5": (UMT5EncoderModel, UMT5Config), "t5": (T5EncoderModel, T5Config), "clip": (CLIPTextModel, CLIPTextConfig),
    "clip_vision": (CLIPVisionModel, CLIPVisionConfig),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config),
}
TEXT_ENCODERS = ("umt5", "t5", "clip")
DIFFUSERS_ARCHS = tuple(_DIFFUSERS)
# Presets that carry trained weights, made here from the synthetic data (no download) by the scripts
# named, and loaded through ``from_pretrained`` like any local checkpoint (times on 2 CPU cores):
# scripts/train_vae.py (the VAE), then scripts/train_world.py (the UMT5 and the Wan generator, jointly).
_ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
TRAINED_ASSETS = {arch: os.path.join(_ASSETS, arch) for arch in ("wan_vae", "umt5", "wan_t2v")}
# The world's text-to-image and image-to-video stages (times on the shared 2-core machine):
# scripts/train_flux_vae.py (the image VAE, 36 min), scripts/train_flux.py (CLIP + T5 + FLUX jointly),
# scripts/train_i2v.py (Wan I2V from the world's T2V, with the world's UMT5 and VAE above: the I2V asset was
# trained in that VAE's latent space and reads that UMT5's states).
TRAINED_ASSETS.update({arch: os.path.join(_ASSETS, arch) for arch in ("vae_kl", "flux", "clip", "t5", "wan_i2v")
                       if os.path.isdir(os.path.join(_ASSETS, arch))})
# The world's pretrained refiner (scripts/train_refiner.py): a ``qwen2`` (Qwen2ForCausalLM, ByT5 bytes) that rewrites a
# user request into the caption the generator reads. Not a preset's default (a plain ``arch: qwen2`` stays the random
# tiny LM); a card names it as ``{arch: qwen2, pretrained: modules/assets/refiner}`` (from the repository root).
REFINER_ASSET = os.path.join(_ASSETS, "refiner")


def model_class(arch: str) -> type[torch.nn.Module]:
    if arch in _DIFFUSERS:
        return _DIFFUSERS[arch]
    return _TRANSFORMERS[arch][0]


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
                preset: dict[str, Any] | None = None, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """One real model: the tiny preset (with ``preset`` overrides: random weights), its trained asset
    (``TRAINED_ASSETS``, when there are no overrides), or ``from_pretrained(pretrained)``."""
    if arch not in PRESETS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(PRESETS)}")
    if pretrained is not None:
        kwargs: dict[str, Any] = {"local_files_only": not os.path.isdir(pretrained)}
        if subfolder:
            kwargs["subfolder"] = subfolder
        if dtype not in (None, torch.float32):
            kwargs["torch_dtype"] = dtype
        expected = model_class(arch).__name__
        config_file = os.path.join(pretrained, subfolder or "", "config.json")
        if os.path.isfile(config_file):
            with open(config_file, encoding="utf-8") as f:
                saved = json.load(f)
            found = saved.get("_class_name")  # diffusers; transformers folders may name a wider class, which loads
            if found and found != expected:
                raise ValueError(f"pretrained={pretrained!r}{f' (subfolder {subfolder!r})' if subfolder else ''} holds "
                                 f"a {found}, but arch {arch!r} is a {expected}: point `pretrained` (and `subfolder`) "
                                 f"at the {expected} folder")
        try:
            return model_class(arch).from_pretrained(pretrained, **kwargs)
        except (OSError, ValueError, TypeError, RuntimeError) as err:
            raise ValueError(
                f"could not load {arch!r} from pretrained={pretrained!r}"
                f"{f' (subfolder {subfolder!r})' if subfolder else ''}: {err}. Give a local folder in the "
                f"layout `save_pretrained` writes, or drop `pretrained` to use the tiny preset."
            ) from err
    if loads_weights(arch, None, preset):
        with _no_progress_bar():  # a shipped tiny asset loads in milliseconds; transformers would draw a bar
            model = model_class(arch).from_pretrained(TRAINED_ASSETS[arch], local_files_only=True)
        return cast(model, dtype)
    config = {**PRESETS[arch], **(preset or {})}
    if arch in _DIFFUSERS:
        model = _DIFFUSERS[arch](**config)
    else:
        cls, config_cls = _TRANSFORMERS[arch]
        model = cls(config_cls(**config))
    return cast(model, dtype)


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
    """The model of a weights folder built from its config alone (weights as the constructor initialises
    them), for a caller that fills the weights itself (``load_weights``): under ``deepspeed.zero.Init`` each
    process then allocates only its partition, where ``from_pretrained`` would build the whole model first."""
    folder = weights_folder(arch, pretrained, subfolder)
    cls = model_class(arch)
    if arch in _DIFFUSERS:
        model = cls.from_config(cls.load_config(folder))
    else:
        model = cls(_TRANSFORMERS[arch][1].from_pretrained(folder))
    return cast(model, dtype)


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
        where = {key: handle for handle in handles for key in handle.keys()}
        names: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        key = {pid: next((k for k in candidates if k in where), None) for pid, candidates in names.items()}
        missing = [names[pid][0] for pid, k in key.items() if k is None]
        if missing:  # decided on every process from the file listing, before any collective
            raise ValueError(f"{folder!r} lacks {len(missing)} weight(s) of the {type(model).__name__} its config "
                             f"builds, e.g. {missing[:3]}: point `pretrained` at a folder save_pretrained wrote for "
                             f"this class")
        for prefix, module in model.named_modules():
            params = list(module.parameters(recurse=False))
            if params:
                with gather(params):
                    if reads:
                        for param in params:
                            param.data.copy_(where[key[id(param)]].get_tensor(key[id(param)]).view_as(param.data))
            for name, buffer in module.named_buffers(recurse=False):
                name = f"{prefix}.{name}" if prefix else name
                if name in where:
                    buffer.copy_(where[name].get_tensor(name))


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


def tokenizer_length(arch: str, config: Any) -> int | None:
    """The ``model_max_length`` a tokenizer built for ``arch`` needs: CLIP pads to its position table."""
    if arch == "clip":
        config = config if isinstance(config, dict) else config.to_dict()
        return int(config["max_position_embeddings"])
    return None
