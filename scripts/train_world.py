"""Pretrain the world's text encoder (UMT5) and text-to-video generator (Wan) together; save both as assets.

Flow matching (rectified flow, logit-normal σ, 10% caption dropout for CFG) on the shipped VAE's
latents of procedurally generated shape videos, with the concepts of ``PRETRAIN_EXCLUDE`` (magenta)
held out so that finetuning has something to teach. The text encoder trains jointly with the
generator, by the same loss: a frozen random encoder gives the generator almost nothing to follow
(DESIGN.md, "Facts measured"). Both keep an EMA of their weights; the EMA is what is saved.

Every ``--eval-every`` steps the EMA models sample ``--eval-prompts`` seen-concept prompts and as many
held-out-concept prompts with the configs' ODE sampler and are scored with synthetic GenEval; the
script stops at ``--steps`` or ``--minutes``, whichever comes first, and prints the scores.

    python scripts/train_world.py --out modules/assets --minutes 40     # 40 min on 2 CPU cores

The shipped ``modules/assets/umt5`` and ``wan_t2v`` are two runs on the shipped VAE's latents, lr 1e-3:

    python scripts/train_world.py --out runs/world --minutes 40                           # 3131 steps
    python scripts/train_world.py --init runs/world --out runs/world2 --minutes 60        # 16778 more steps

(the second on one thread, 0.2 s a step). ``--evaluate modules/assets`` reads back, on 64 seen-concept prompts
without CFG, shape 0.75, colour 1.0, background 1.0, motion 0.97, all four 0.73 (chance: 1/3, 1/6, 1/6, 1/4);
with ``--guidance 4.5`` 0.94 / 1.0 / 1.0 / 1.0, all four 0.94. Held-out-concept prompts: all four 0.0.

The long world ``modules/assets/world21`` (21-frame clips = 6 latent frames, the shape moving at the 5-frame world's
pace, ``--speed 0.0625``, so its motion continues over the clip; Self-Forcing's teacher in
``configs/self_forcing_long.yaml``) continues the shipped pair at that length, then continues itself, read through
the long world's VAE (``modules/assets/world21/wan_vae``: the shipped codec's decoder finetuned on 21-frame clips,
``scripts/train_vae.py --stage long-decoder``; its encoder, so the latents trained on, unchanged), one thread:

    python scripts/train_world.py --init modules/assets --out runs/world21 --frames 21 --speed 0.0625 --minutes 40
                                                                                          # 1277 steps, 40.0 min
    python scripts/train_world.py --init runs/world21 --out modules/assets/world21 --frames 21 --speed 0.0625 \
        --minutes 45 --lr 3e-4 --eval-every 400 --vae runs/vae21 --guidance 4.5      # 3969 steps, 45.0 min

(``runs/vae21``: the long-decoder stage at 2000 steps and lr 3e-4, the check while it trained; the shipped one is
8000 steps.) ``--evaluate modules/assets/world21 --frames 21 --vae modules/assets/world21/wan_vae`` reads back, on
the full 21 frames of the same 64 seen-concept prompts, without CFG shape 0.52, colour 0.58, background 1.0, motion
0.78, all four 0.30; with ``--guidance 4.5`` 0.83 / 0.83 / 1.0 / 1.0, all four 0.67. Held-out-concept prompts: all
four 0.0. Read through the 5-frame codec (the default ``--vae``), whose decoder loses every fact past the first 5
frames, the first 40 minutes read back all four 0.08 with CFG; through the long decoder 0.31.

Writes ``<out>/umt5`` and ``<out>/wan_t2v`` (``save_pretrained``, safetensors). Needs the VAE asset
(``scripts/train_vae.py``) first: the generator is trained in that VAE's latent space.
"""
from __future__ import annotations

import argparse
import copy
import json
import os

import torch
from diffusers import WanTransformer3DModel
from safetensors.torch import load_file, save_file
from transformers import ByT5Tokenizer, UMT5Config, UMT5EncoderModel

from posttrain.datamodules.synthetic import PRETRAIN_EXCLUDE, ShapesDataset
from posttrain.modules.models import vae as vae_codec
from posttrain.modules.flow.conditioning import Conditioning
from posttrain.modules.eval.evaluation import evaluate_generator
from posttrain.modules.flow.losses import flow_matching_loss, noised, sample_sigmas
from posttrain.modules.models.presets import PRESETS, TRAINED_ASSETS, build_model
from posttrain.modules.models.generators import ADAPTERS, wan_text_states, wan_tokens
from posttrain.modules.flow.samplers import FlowMatchSampler
from posttrain.modules.world.world import PACE, SPEED
from pretraining import loop_arguments, pretrain  # beside this script, which runs as a file


def encoded_dataset(vae, num_videos: int, frames: int, size: int, cache: str,
                    speed: float | None = None) -> tuple[torch.Tensor, list[str]]:
    """(N, z, F', h, w) normalized latents of the pretraining videos and their captions, cached on disk
    (keyed by the arguments and the VAE's encoder: a retrained decoder does not move the latents)."""
    encoder_sum = sum(float(p.double().sum()) for p in [*vae.encoder.parameters(), *vae.quant_conv.parameters()])
    key = f"{num_videos}-{frames}-{size}-{'-'.join(PRETRAIN_EXCLUDE)}-{encoder_sum:.6f}-{vae.config.latents_mean}"
    if speed is not None:  # the shipped runs' key stays as it was
        key += f"-speed{speed}"
    if os.path.exists(cache):
        stored = load_file(cache)
        meta = json.loads(bytes(stored["meta"].tolist()).decode())
        if meta["key"] == key:
            return stored["latents"], meta["prompts"]
    data = ShapesDataset(num_videos, frames, size, size, seed=1, exclude=PRETRAIN_EXCLUDE, speed=speed)
    latents, prompts = [], []
    for i in range(0, num_videos, 32):
        items = [data[j] for j in range(i, min(i + 32, num_videos))]
        latents.append(vae_codec.encode(vae, torch.stack([it["video"] for it in items])))
        prompts += [it["prompt"] for it in items]
        print(f"encoded {len(prompts)}/{num_videos} videos", flush=True)
    latents = torch.cat(latents)
    meta = torch.tensor(list(json.dumps({"key": key, "prompts": prompts}).encode()), dtype=torch.uint8)
    os.makedirs(os.path.dirname(os.path.abspath(cache)), exist_ok=True)
    save_file({"latents": latents.contiguous(), "meta": meta}, cache)
    return latents, prompts


def geneval(transformer, encoder, tokenizer, vae, args) -> dict[str, dict[str, float]]:
    """Synthetic GenEval of ODE samples (the configs' sampler) of ``--eval-prompts`` seen-concept and as
    many held-out-concept prompts (fixed seeds: every check and ``--evaluate`` scores the same prompts)."""
    seen = ShapesDataset(args.eval_prompts, 1, 8, 8, seed=2, exclude=PRETRAIN_EXCLUDE)
    held_out = ShapesDataset(args.eval_prompts, 1, 8, 8, seed=3, include=PRETRAIN_EXCLUDE)
    scores = {}
    for name, data in {"seen": seen, "held_out": held_out}.items():
        result = evaluate_generator(transformer, encoder, tokenizer, vae, [data[i]["prompt"] for i in range(len(data))],
                                    frames=args.frames, height=args.size, width=args.size,
                                    sampler=FlowMatchSampler(num_steps=20, guidance_scale=args.guidance),
                                    text_max_length=args.text_max_length)
        scores[name] = {k: round(float(v), 3) for k, v in result.items()}
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vae", default=TRAINED_ASSETS["wan_vae"])
    parser.add_argument("--videos", type=int, default=4096, help="pretraining videos (encoded once, cached)")
    parser.add_argument("--frames", type=int, default=5, help="clip length in frames (4k+1: k+1 latent frames)")
    parser.add_argument("--speed", type=float, help="how far the shape moves per frame step, a fraction of the "
                        f"frame ({PACE}: the shipped 5-frame world's pace, continued over a longer clip); unset: "
                        f"{SPEED} over the whole clip")
    parser.add_argument("--size", type=int, default=32)
    loop_arguments(parser, steps=20000, minutes=90.0, ema=0.998, eval_every=1000)
    parser.add_argument("--caption-dropout", type=float, default=0.1)
    parser.add_argument("--text-max-length", type=int, default=64)
    parser.add_argument("--eval-prompts", type=int, default=64)
    parser.add_argument("--guidance", type=float, default=1.0, help="CFG scale of the evaluation samples")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (on a shared machine more spin)")
    parser.add_argument("--cache", default="runs/world/latents.safetensors")
    parser.add_argument("--out", default="modules/assets")
    parser.add_argument("--init", metavar="FOLDER", help="start from the umt5 and wan_t2v in FOLDER (e.g. "
                        "modules/assets, to continue a run) instead of a random initialization")
    parser.add_argument("--evaluate", metavar="FOLDER", help="train nothing: print the evaluation of the umt5 "
                        "and wan_t2v in FOLDER (e.g. modules/assets) on the eval prompts, and stop")
    args = parser.parse_args()
    if args.frames < 1 or (args.frames - 1) % 4:
        parser.error(f"--frames {args.frames}: the Wan VAE encodes 4k+1 frames (5, 9, 13, 17, ...)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    vae = build_model("wan_vae", pretrained=args.vae).eval().requires_grad_(False)
    if args.evaluate:
        encoder = build_model("umt5", pretrained=os.path.join(args.evaluate, "umt5")).eval()
        transformer = build_model("wan_t2v", pretrained=os.path.join(args.evaluate, "wan_t2v")).eval()
        print("geneval", json.dumps(geneval(transformer, encoder, ByT5Tokenizer(), vae, args)), flush=True)
        return
    latents, prompts = encoded_dataset(vae, args.videos, args.frames, args.size, args.cache, args.speed)
    print(f"{len(prompts)} pretraining videos, latents {tuple(latents.shape[1:])}", flush=True)

    tokenizer = ByT5Tokenizer()
    if args.init:
        encoder = build_model("umt5", pretrained=os.path.join(args.init, "umt5")).train()
        transformer = build_model("wan_t2v", pretrained=os.path.join(args.init, "wan_t2v")).train()
    else:
        encoder = UMT5EncoderModel(UMT5Config(**PRESETS["umt5"])).train()
        transformer = WanTransformer3DModel(**PRESETS["wan_t2v"]).train()
    print(f"UMT5 {sum(p.numel() for p in encoder.parameters()) / 1e6:.3f}M, Wan "
          f"{sum(p.numel() for p in transformer.parameters()) / 1e6:.3f}M parameters", flush=True)
    encoder_ema, transformer_ema = copy.deepcopy(encoder).eval(), copy.deepcopy(transformer).eval()

    def evaluate(step: int, minutes: float) -> dict:
        scores = {"step": step, "minutes": minutes, **geneval(transformer_ema, encoder_ema, tokenizer, vae, args)}
        print("geneval", json.dumps(scores), flush=True)
        # save at every evaluation, so a run stopped early still leaves its latest assets
        encoder_ema.save_pretrained(os.path.join(args.out, "umt5"), safe_serialization=True)
        transformer_ema.save_pretrained(os.path.join(args.out, "wan_t2v"), safe_serialization=True)
        return scores

    # every caption is tokenized once; the empty prompt (caption dropout) is the last row
    ids, mask = wan_tokens(tokenizer, prompts + [""], args.text_max_length)

    def loss_of(g: torch.Generator) -> torch.Tensor:
        idx = torch.randint(len(prompts), (args.batch_size,), generator=g)
        x0 = latents[idx]
        # 1. captions, a share dropped to the empty prompt (the unconditional branch of CFG)
        drop = torch.rand(args.batch_size, generator=g) < args.caption_dropout
        rows = torch.where(drop, len(prompts), idx)
        cond = Conditioning(encoder_hidden_states=wan_text_states(encoder, ids[rows], mask[rows]))
        # 2. x_σ = (1-σ)·x0 + σ·ε at logit-normal σ; v_θ regressed onto ε - x0, through both models
        sigma = sample_sigmas(args.batch_size, "logit_normal", g)
        noise = torch.randn(x0.shape, generator=g)
        v = ADAPTERS["wan_t2v"].velocity(transformer, noised(x0, noise, sigma), sigma * 1000, cond)
        return flow_matching_loss(v, x0, noise)[0].mean()

    step, minutes, _ = pretrain(loss_of, {"text_encoder": encoder, "transformer": transformer},
                                {"text_encoder": encoder_ema, "transformer": transformer_ema}, args, evaluate)
    print(f"saved {args.out}/umt5 and {args.out}/wan_t2v after {step} steps, {minutes} min")


if __name__ == "__main__":
    main()
