"""Write the *config files only* of the real models the recipes name, in the diffusers / transformers folder
layout, so that ``posttrain estimate`` (which builds every expert on the meta device from its config) runs on
the recipes without the weights. No weights are written and nothing is downloaded: the configs are the published
models' (``modules/models/published.py``: Wan2.1-T2V-1.3B and -14B, Wan2.1-I2V-14B, FLUX.1-dev, SD3.5-medium,
Qwen2.5-0.5B-Instruct, each in the folder ``huggingface-cli download <repo> --local-dir`` would fill), plus
openai/clip-vit-large-patch14 — the CLIPScore reward's folder, whose model estimate does not count: it is not an
expert of the card.

    python scripts/config_folders.py --out /models
    posttrain estimate --config configs/recipes/wan2.1_t2v_1.3b_finetune.yaml --devices 8

Without any folder, ``posttrain estimate --random_weights true`` reads the same configs from the package.
"""
from __future__ import annotations

import argparse
import os

from diffusers import ModelMixin
from transformers import CLIPConfig

from posttrain.modules.models import presets
from posttrain.modules.models.published import CLIP_L_TEXT, CLIP_L_VISION, PUBLISHED


def published_folder(out: str, name: str) -> str:
    """The config files of every component of published model ``name`` under ``out/<its folder>``."""
    model = PUBLISHED[name]
    root = os.path.join(out, model.folder)
    for subfolder, (arch, _) in model.components.items():
        built = presets.build_model(arch, subfolder=subfolder or None, published=name, device="meta")
        folder = os.path.join(root, subfolder)
        if isinstance(built, ModelMixin):
            built.save_config(folder)
        else:
            built.config.save_pretrained(folder)
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/models")
    out = parser.parse_args().out
    for name in PUBLISHED:
        published_folder(out, name)
    text = {k: v for k, v in CLIP_L_TEXT.items() if k != "architectures"}
    CLIPConfig(text_config=text, vision_config=CLIP_L_VISION, projection_dim=768,
               architectures=["CLIPModel"]).save_pretrained(os.path.join(out, "clip-vit-large-patch14"))
    print(f"config folders (no weights) under {out}")


if __name__ == "__main__":
    main()
