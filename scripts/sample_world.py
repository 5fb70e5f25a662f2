"""Look at the pretrained world: sample GIFs and one PNG grid of their frames, with what GenEval reads.

For each prompt (by default six seen-concept and two held-out-concept synthetic captions) the shipped
generator samples one video with the configs' ODE sampler; each is written as a GIF, and a PNG grid
shows every frame of every sample in a row (upscaled ``--scale`` times, nearest neighbour), the
prompt and the facts read back from it above the row. A data row per prompt (``--with-data``) puts
the rendered ground truth under each sample.

    python scripts/sample_world.py --out runs/world_samples     # about a minute on 2 CPU cores
"""
from __future__ import annotations

import argparse
import os

import torch

from posttrain.datamodules.synthetic import PRETRAIN_EXCLUDE, ShapesDataset
from posttrain.modules.models import presets
from posttrain.modules.eval.evaluation import generate
from posttrain.modules.world.geneval import read_facts
from posttrain.modules.io.media import grid, slug, write_media
from posttrain.modules.flow.samplers import FlowMatchSampler
from posttrain.modules.world.world import caption, parse_caption, render


def describe(video: torch.Tensor) -> str:
    facts = read_facts(video)
    return f"read: {facts.colour} {facts.shape} moving {facts.motion} on {facts.background}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", nargs="*", help="prompts to sample; default: synthetic captions")
    parser.add_argument("--seen", type=int, default=6, help="seen-concept captions when --prompts is not given")
    parser.add_argument("--held-out", type=int, default=2, help="held-out-concept captions likewise")
    parser.add_argument("--transformer", default=presets.TRAINED_ASSETS["wan_t2v"])
    parser.add_argument("--text-encoder", default=presets.TRAINED_ASSETS["umt5"])
    parser.add_argument("--vae", default=presets.TRAINED_ASSETS["wan_vae"])
    parser.add_argument("--guidance", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--scale", type=int, default=4)
    parser.add_argument("--with-data", action="store_true", help="add a ground-truth row under each sample")
    parser.add_argument("--out", default="runs/world_samples")
    args = parser.parse_args()
    torch.set_num_threads(2)

    prompts = args.prompts
    if not prompts:
        seen = ShapesDataset(args.seen, 1, 8, 8, seed=11, exclude=PRETRAIN_EXCLUDE)
        held = ShapesDataset(args.held_out, 1, 8, 8, seed=12, include=PRETRAIN_EXCLUDE) if args.held_out else []
        prompts = [seen[i]["prompt"] for i in range(len(seen))] + [held[i]["prompt"] for i in range(len(held))]
    transformer = presets.build_model("wan_t2v", pretrained=args.transformer).eval()
    encoder = presets.build_model("umt5", pretrained=args.text_encoder).eval()
    vae = presets.build_model("wan_vae", pretrained=args.vae).eval()
    sampler = FlowMatchSampler(num_steps=args.steps, guidance_scale=args.guidance)
    videos = generate(transformer, encoder, presets.build_tokenizer(), vae, prompts, seed=args.seed,
                      frames=args.frames, height=args.size, width=args.size, sampler=sampler)

    os.makedirs(args.out, exist_ok=True)
    rows = []
    for i, (prompt, video) in enumerate(zip(prompts, videos)):
        write_media(os.path.join(args.out, f"{i:02d}_{slug(prompt)}.gif"), video)
        rows.append((f"{prompt} | {describe(video)}", video))
        if args.with_data:
            asked = parse_caption(prompt)
            truth = render(asked.shape, asked.colour, asked.motion, asked.background, args.frames, args.size, args.size)
            rows.append((f"data: {caption(asked.shape, asked.colour, asked.motion, asked.background)}", truth))
    path = os.path.join(args.out, "grid.png")
    grid(rows, args.scale).save(path)
    print(f"wrote {len(prompts)} GIFs and {path}")


if __name__ == "__main__":
    main()
