"""Write the *config files only* of the real models the recipes name, in the diffusers / transformers folder
layout, so that ``posttrain estimate`` (which builds every expert on the meta device from its config) runs on
the recipes without the weights. No weights are written and nothing is downloaded: the configs are those the
hub folders ship (Wan-AI/Wan2.1-T2V-1.3B-Diffusers, Wan-AI/Wan2.1-T2V-14B-Diffusers, Qwen/Qwen2.5-0.5B-Instruct,
black-forest-labs/FLUX.1-dev, openai/clip-vit-large-patch14 — the CLIPScore reward's folder, whose model estimate
does not count: it is not an expert of the card).

    python scripts/config_folders.py --out /models
    posttrain estimate --config configs/recipes/wan2.1_t2v_1.3b_finetune.yaml --devices 8
"""
from __future__ import annotations

import argparse
import os

import torch
from diffusers import AutoencoderKL, AutoencoderKLWan, FluxTransformer2DModel, WanTransformer3DModel
from transformers import CLIPConfig, CLIPTextConfig, Qwen2Config, T5Config, UMT5Config

WAN = dict(patch_size=(1, 2, 2), attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
           freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
WAN_1_3B = dict(WAN, num_attention_heads=12, ffn_dim=8960, num_layers=30)
WAN_14B = dict(WAN, num_attention_heads=40, ffn_dim=13824, num_layers=40)
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                relative_attention_num_buckets=32, relative_attention_max_distance=128,
                feed_forward_proj="gated-gelu", tie_word_embeddings=False, architectures=["UMT5EncoderModel"])
QWEN_0_5B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                 tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"])

# FLUX.1-dev: the diffusers class defaults are its transformer (19 double, 38 single blocks, 24 x 128 heads) but
# for the guidance embedding of the guidance-distilled dev model; CLIP ViT-L/14's text tower; T5-XXL v1.1
FLUX_DEV = dict(guidance_embeds=True)
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


def flux_folder(root: str) -> None:
    with torch.device("meta"):
        FluxTransformer2DModel(**FLUX_DEV).save_config(os.path.join(root, "transformer"))
        AutoencoderKL(**FLUX_VAE).save_config(os.path.join(root, "vae"))
    CLIPTextConfig(**CLIP_L_TEXT).save_pretrained(os.path.join(root, "text_encoder"))
    T5Config(**T5_XXL).save_pretrained(os.path.join(root, "text_encoder_2"))


def wan_folder(root: str, transformer: dict) -> None:
    with torch.device("meta"):
        WanTransformer3DModel(**transformer).save_config(os.path.join(root, "transformer"))
        AutoencoderKLWan().save_config(os.path.join(root, "vae"))  # the Wan 2.1 VAE is the class default
    UMT5Config(**UMT5_XXL).save_pretrained(os.path.join(root, "text_encoder"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/models")
    out = parser.parse_args().out
    wan_folder(os.path.join(out, "Wan2.1-T2V-1.3B-Diffusers"), WAN_1_3B)
    wan_folder(os.path.join(out, "Wan2.1-T2V-14B-Diffusers"), WAN_14B)
    Qwen2Config(**QWEN_0_5B).save_pretrained(os.path.join(out, "Qwen2.5-0.5B-Instruct"))
    flux_folder(os.path.join(out, "FLUX.1-dev"))
    text = {k: v for k, v in CLIP_L_TEXT.items() if k != "architectures"}
    CLIPConfig(text_config=text, vision_config=CLIP_L_VISION, projection_dim=768,
               architectures=["CLIPModel"]).save_pretrained(os.path.join(out, "clip-vit-large-patch14"))
    print(f"config folders (no weights) under {out}")


if __name__ == "__main__":
    main()
