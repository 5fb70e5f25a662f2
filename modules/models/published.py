"""The published models the recipes name, as config facts: every component's architecture and its constructor
config, so that an expert can be built at real size without the weights.

``PUBLISHED``: model name -> ``Published`` (its hub repository and its components, ``subfolder -> (arch, config)``;
``""`` for a single-folder model). The configs are those the hub folders ship (``transformer/config.json``,
``vae/config.json``, ``text_encoder/config.json``...), written as the constructor arguments of the class the
``arch`` names (``modules/models/presets.py``). ``scripts/config_folders.py`` writes config-only folders from them
for ``posttrain estimate``.

An expert with ``published: Wan2.1-T2V-14B`` (``Expert.published``) is that model's component — its ``subfolder``,
or the one component of its ``arch`` — at real size with random weights: built on the meta device, then each
module's parameters allocated and filled in turn (``materialize``), so no second full copy is ever held. The
weights are a function of the model name, the component and the module's name alone (each module is initialised
from its own seed), so the same card builds the same weights: a resume rebuilds them and checks their digest, and a
model built with fewer layers (``preset: {num_layers: 1}``) has the full model's first blocks.

    from posttrain.modules.models import presets
    model = presets.build_model("wan_t2v", published="Wan2.1-T2V-1.3B", dtype=torch.bfloat16)  # 1.42e9, random
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
from torch import nn

from posttrain.modules.models.generators.wan22_ti2v import WAN22_LATENTS_MEAN, WAN22_LATENTS_STD

# ---------------------------------------------------------------------- the config facts
# Wan2.1 (Wan-AI/Wan2.1-*-Diffusers, transformer/config.json): WanTransformer3DModel; the 14B I2V adds the CLIP image
# tokens' projection (image_dim: the image encoder's width; added_kv_proj_dim: the model's, 40 x 128) and reads
# 16 noisy + 4 mask + 16 first-frame latent channels
WAN = dict(patch_size=(1, 2, 2), attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
           freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
WAN_1_3B = dict(WAN, num_attention_heads=12, ffn_dim=8960, num_layers=30)
WAN_14B = dict(WAN, num_attention_heads=40, ffn_dim=13824, num_layers=40)
WAN_I2V_14B = dict(WAN_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120)
# AutoencoderKLWan of Wan 2.1 (vae/config.json): 8x spatial, 4x temporal, 16 latent channels; the class defaults
WAN_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
               temperal_downsample=[False, True, True], dropout=0.0)
# Wan2.2-TI2V-5B (Wan-AI/Wan2.2-TI2V-5B-Diffusers; diffusers' scripts/convert_wan_to_diffusers.py, "Wan2.2-TI2V-5B" and
# vae22_diffusers_config; the Wan 2.2 repository's wan_ti2v_5B.py: dim 3072, ffn 14336, 24 heads, 30 layers): the
# transformer reads the 48 latent channels alone; the Wan 2.2 VAE folds 2x2 pixels into 12 channels (patch_size 2),
# residual blocks, 16x spatial, 4x temporal, 48 latent channels with their own mean/std (the family file's, which
# its tiny VAE shares)
WAN_TI2V_5B = dict(WAN, num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48, out_channels=48)
WAN22_VAE = dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                 temperal_downsample=[False, True, True], dropout=0.0, is_residual=True, in_channels=12,
                 out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
                 latents_mean=WAN22_LATENTS_MEAN, latents_std=WAN22_LATENTS_STD)
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                relative_attention_num_buckets=32, relative_attention_max_distance=128,
                feed_forward_proj="gated-gelu", tie_word_embeddings=False, architectures=["UMT5EncoderModel"])
# Wan2.1-I2V's image encoder: CLIP ViT-H/14's vision tower (the pipeline reads its penultimate hidden states)
CLIP_H_VISION = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                     image_size=224, patch_size=14, projection_dim=1024, hidden_act="gelu",
                     architectures=["CLIPVisionModelWithProjection"])
QWEN_0_5B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                 tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"])

# FLUX.1-dev (black-forest-labs/FLUX.1-dev): 19 double and 38 single blocks of 24 x 128 heads, the guidance embedding
# of the guidance-distilled dev model; CLIP ViT-L/14's text tower; T5-XXL v1.1
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
FLUX_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
                down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                layers_per_block=2, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
                use_quant_conv=False, use_post_quant_conv=False)
CLIP_L_TEXT = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                   num_attention_heads=12, max_position_embeddings=77, projection_dim=768,
                   architectures=["CLIPTextModel"])
CLIP_L_VISION = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                     image_size=224, patch_size=14, projection_dim=768)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              feed_forward_proj="gated-gelu", tie_word_embeddings=False, architectures=["T5EncoderModel"])

# Stable Diffusion 3.5 Medium (stabilityai/stable-diffusion-3.5-medium): MMDiT-X, 24 blocks of 24 x 64 heads, the
# first 13 with a second (image-only) attention, QK RMS norm; its VAE is FLUX's layout with SD3's normalization;
# CLIP-L and OpenCLIP bigG (both with their text projection, pooled 768 + 1280 = 2048) and T5-XXL
SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                   attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                   pooled_projection_dim=2048, pos_embed_max_size=384, dual_attention_layers=tuple(range(13)),
                   qk_norm="rms_norm")
SD3_VAE = dict(FLUX_VAE, scaling_factor=1.5305, shift_factor=0.0609)
CLIP_L_PROJECTION = dict(CLIP_L_TEXT, architectures=["CLIPTextModelWithProjection"])
CLIP_G_PROJECTION = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                         num_attention_heads=20, max_position_embeddings=77, projection_dim=1280, hidden_act="gelu",
                         architectures=["CLIPTextModelWithProjection"])

# Qwen-Image (Qwen/Qwen-Image): a 60-block MMDiT of 24 x 128 heads reading Qwen2.5-VL-7B's 3584-wide states (its
# transformer/config.json: the class defaults of QwenImageTransformer2DModel); its VAE is Wan 2.1's layout with
# Qwen-Image's weights (vae/config.json: the class defaults of AutoencoderKLQwenImage, latents_mean/std included); its
# text encoder is Qwen2.5-VL-7B-Instruct (text_encoder/config.json: a 28-layer Qwen2.5 LM, GQA 28/4, M-RoPE sections
# 16/24/24, untied head, and the 32-block vision tower, unused for text)
QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
QWEN_IMAGE_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                      temperal_downsample=[False, True, True], dropout=0.0)
QWEN2_5_VL_7B = dict(
    text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6,
                     max_window_layers=28, hidden_act="silu", bos_token_id=151643, eos_token_id=151645,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_chans=3,
                       out_hidden_size=3584, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                       window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, hidden_act="silu"),
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    tie_word_embeddings=False, architectures=["Qwen2_5_VLForConditionalGeneration"])


@dataclass(frozen=True)
class Published:
    """One published model: its hub repository (``org/name``: the folder ``huggingface-cli download`` writes is
    ``name``) and its components, ``subfolder -> (arch, constructor config)`` (``""``: the folder itself)."""

    repo: str
    components: Mapping[str, tuple[str, dict[str, Any]]]

    @property
    def folder(self) -> str:
        return self.repo.rpartition("/")[2]


_WAN_SHARED = {"vae": ("wan_vae", WAN_VAE), "text_encoder": ("umt5", UMT5_XXL)}
PUBLISHED: dict[str, Published] = {
    "Wan2.1-T2V-1.3B": Published("Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
                                 {"transformer": ("wan_t2v", WAN_1_3B), **_WAN_SHARED}),
    "Wan2.1-T2V-14B": Published("Wan-AI/Wan2.1-T2V-14B-Diffusers", {"transformer": ("wan_t2v", WAN_14B), **_WAN_SHARED}),
    "Wan2.1-I2V-14B": Published("Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
                                {"transformer": ("wan_i2v", WAN_I2V_14B), **_WAN_SHARED,
                                 "image_encoder": ("clip_vision", CLIP_H_VISION)}),
    # Wan2.2-T2V-A14B: a pair of noise experts of the 14B layout (the Wan 2.2 repository's wan_t2v_A14B.py: dim 5120,
    # ffn 13824, 40 heads, 40 layers; its model_index.json: boundary_ratio 0.875, the card's), Wan 2.1's VAE and UMT5
    "Wan2.2-T2V-A14B": Published("Wan-AI/Wan2.2-T2V-A14B-Diffusers",
                                 {"transformer": ("wan_t2v", WAN_14B), "transformer_2": ("wan_t2v", WAN_14B),
                                  **_WAN_SHARED}),
    # Wan2.2-TI2V-5B: one transformer for text- and image-to-video (``arch: wan22_ti2v`` or ``wan22_ti2v_i2v``, the same
    # weights), the Wan 2.2 VAE, UMT5-XXL as Wan 2.1's
    "Wan2.2-TI2V-5B": Published("Wan-AI/Wan2.2-TI2V-5B-Diffusers",
                                {"transformer": ("wan22_ti2v", WAN_TI2V_5B), "vae": ("wan22_vae", WAN22_VAE),
                                 "text_encoder": ("umt5", UMT5_XXL)}),
    "FLUX.1-dev": Published("black-forest-labs/FLUX.1-dev",
                            {"transformer": ("flux", FLUX_DEV), "vae": ("vae_kl", FLUX_VAE),
                             "text_encoder": ("clip", CLIP_L_TEXT), "text_encoder_2": ("t5", T5_XXL)}),
    "SD3.5-medium": Published("stabilityai/stable-diffusion-3.5-medium",
                              {"transformer": ("sd3", SD35_MEDIUM), "vae": ("vae_kl", SD3_VAE),
                               "text_encoder": ("clip_projection", CLIP_L_PROJECTION),
                               "text_encoder_2": ("clip_projection", CLIP_G_PROJECTION),
                               "text_encoder_3": ("t5", T5_XXL)}),
    "Qwen2.5-0.5B-Instruct": Published("Qwen/Qwen2.5-0.5B-Instruct", {"": ("qwen2", QWEN_0_5B)}),
    "Qwen-Image": Published("Qwen/Qwen-Image", {"transformer": ("qwen_image", QWEN_IMAGE),
                                                "vae": ("qwen_image_vae", QWEN_IMAGE_VAE),
                                                "text_encoder": ("qwen2_5_vl", QWEN2_5_VL_7B)}),
}


# ---------------------------------------------------------------------- names
def known() -> str:
    return ", ".join(PUBLISHED)


def published(name: str) -> Published:
    """The published model ``name``; an unknown name is refused listing the known ones."""
    if name not in PUBLISHED:
        raise ValueError(f"published={name!r} is not a published model this package knows; choose one of {known()}")
    return PUBLISHED[name]


def name_of_folder(folder: str) -> str:
    """The published model a ``pretrained`` folder holds, by the folder's name (``/models/Wan2.1-T2V-14B-Diffusers``
    -> ``Wan2.1-T2V-14B``: the name ``huggingface-cli download <repo> --local-dir`` recipes use, or the model's own
    name); an unknown folder name is refused listing the known ones."""
    base = os.path.basename(os.path.normpath(folder))
    for name, model in PUBLISHED.items():
        if base in (name, model.folder):
            return name
    raise ValueError(f"pretrained={folder!r}: its folder name {base!r} is no published model this package knows, so "
                     f"--random_weights cannot tell which architecture to build; known folder names: "
                     f"{', '.join(m.folder for m in PUBLISHED.values())}")


def compatible(arch: str, component_arch: str) -> bool:
    """Whether an expert of ``arch`` can be built from a component of ``component_arch``: the same architecture, or a
    subclass of its class with its config (Wan's block-causal student of a Wan T2V)."""
    from posttrain.modules.models.generators import ARCHITECTURES  # the families' archs: the generators

    return arch == component_arch or (arch in ARCHITECTURES and component_arch in ARCHITECTURES and issubclass(
        ARCHITECTURES[arch].cls, ARCHITECTURES[component_arch].cls) and ARCHITECTURES[arch].kind == "generator")


def component(name: str, arch: str, subfolder: Optional[str] = None) -> str:
    """The component of published model ``name`` an expert of ``arch`` is: ``subfolder`` when given, else the one
    component of that architecture. Refused, naming the components: an unknown subfolder, one of another
    architecture, none or several of ``arch`` without a ``subfolder``."""
    model = published(name)
    listing = ", ".join(f"{sub or '(the folder)'}: {a}" for sub, (a, _) in model.components.items())
    if subfolder is not None or "" in model.components:
        sub = subfolder or ""
        if sub not in model.components:
            raise ValueError(f"published={name!r} has no component {subfolder!r}; its components are {listing}")
        if not compatible(arch, model.components[sub][0]):
            raise ValueError(f"published={name!r}, subfolder {subfolder!r} is a {model.components[sub][0]!r}, not arch "
                             f"{arch!r}; its components are {listing}")
        return sub
    matches = [sub for sub, (a, _) in model.components.items() if compatible(arch, a)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ValueError(f"published={name!r} has no {arch!r} component; its components are {listing}")
    raise ValueError(f"published={name!r} has {len(matches)} {arch!r} components ({', '.join(matches)}): give the "
                     f"expert's `subfolder`")


def config(name: str, arch: str, subfolder: Optional[str] = None) -> dict[str, Any]:
    """The constructor config of the component of ``name`` an expert of ``arch`` builds (``presets.build_model``
    merges an expert's ``preset`` overrides into it, e.g. ``{num_layers: 1}``: the published widths with one
    block)."""
    return dict(published(name).components[component(name, arch, subfolder)][1])


def seed_of(name: str, arch: str, subfolder: Optional[str] = None) -> str:
    """What an expert's random weights are drawn from: the model and the component (each module adds its name)."""
    return f"{name}/{component(name, arch, subfolder) or arch}"


# ---------------------------------------------------------------------- random weights at real size
@contextlib.contextmanager
def empty_weights():
    """Parameters on the meta device, buffers real (rotary tables and position ids are computed from the config:
    ``to_empty`` would leave them uninitialised). accelerate's ``init_empty_weights``."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        yield


@torch.no_grad()
def materialize(model: nn.Module, seed: str, device: str = "cpu") -> nn.Module:
    """Give every meta parameter of ``model`` storage on ``device`` and deterministic random values, one module at a
    time, so at most the model's own weights are ever held.

    Each module is initialised from its own seed, ``sha256(seed/module name)``: by its ``reset_parameters`` where it
    has one (Linear, Conv, LayerNorm, Embedding: PyTorch's default initialisation, what a diffusers model's constructor
    leaves); any other parameter as the constructors of these models set it: a norm's ``weight`` to 1, a ``bias`` to
    0, anything else (Wan's and FLUX's modulation tables) normal with std 1/sqrt(last dim). A parameter shared by
    two modules (tied embeddings) is allocated once.
    """
    done: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        own = {key: p for key, p in module._parameters.items() if p is not None}
        if not own:
            continue
        fresh = [key for key, p in own.items() if p.is_meta and id(p) not in done]
        for key, p in own.items():
            if id(p) in done:
                module._parameters[key] = done[id(p)]
            elif p.is_meta:
                new = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                done[id(p)] = module._parameters[key] = new
        if not fresh:
            continue
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int.from_bytes(hashlib.sha256(f"{seed}/{module_name}".encode()).digest()[:8], "little"))
            reset = getattr(module, "reset_parameters", None)
            if callable(reset) and len(fresh) == len(own):
                reset()
            else:
                for key in fresh:
                    _fill(module, key)
    return model


def _fill(module: nn.Module, key: str) -> None:
    param = module._parameters[key]
    if key == "bias":
        param.zero_()
    elif key == "weight" and param.dim() == 1 and "norm" in type(module).__name__.lower():
        param.fill_(1.0)
    else:
        param.normal_(0.0, param.shape[-1] ** -0.5)
