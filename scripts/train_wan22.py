"""Make the tiny Wan 2.2-style pair of noise experts: two copies of the world's Wan generator, each trained on its
own noise range, and measure that each is better on its range than one model trained on the whole range.

``transformer`` (high noise) continues the world's ``wan_t2v`` on σ >= ``--boundary`` (σ = t / 1000: the steps
``WanPipeline`` gives it at ``boundary_ratio``), ``transformer_2`` (low noise) on σ below it; the control continues
the same weights on all σ for as many steps as the two experts together. Flow matching on the world's pretraining
latents (``scripts/train_world.py``'s data and loss, logit-normal σ mapped onto each range, 10% caption dropout),
the world's UMT5 frozen. Each model keeps an EMA, which is what is measured and saved.

Measured, on held-out latents: the flow-matching loss on each range (8 σ inside it, fixed noise) of the world's
model, the control and the range's expert; and synthetic GenEval of 20-step ODE samples (the configs' sampler,
shift 3) of 64 seen-concept prompts: the world's model, the control, and the pair routed at the boundary.

    python scripts/train_wan22.py --out modules/assets/wan22_t2v --steps 400     # one thread

Writes ``<out>/transformer`` and ``<out>/transformer_2`` (``save_pretrained``; ``configs/flow_grpo_wan22.yaml``
loads them with ``pretrained:``) and ``<out>/measured.json``.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import time

import torch
from transformers import ByT5Tokenizer

from posttrain.datamodules.synthetic import PRETRAIN_EXCLUDE, ShapesDataset
from posttrain.modules.flow.conditioning import Conditioning
from posttrain.modules.flow.losses import flow_matching_loss, noised, sample_sigmas
from posttrain.modules.eval.evaluation import evaluate_generator
from posttrain.modules.flow.samplers import FlowMatchSampler
from posttrain.modules.models.generators import ADAPTERS, wan_text_states, wan_tokens
from posttrain.modules.models.presets import TRAINED_ASSETS, build_model

from pretraining import ema_update  # noqa: E402  (scripts/ is the script's own folder)
from train_world import encoded_dataset  # noqa: E402

HELD_OUT = 256  # the last latents of the dataset: never trained on, the flow-matching loss is measured on them


def train(transformer: torch.nn.Module, latents: torch.Tensor, states: torch.Tensor, low: float, high: float,
          args, name: str) -> torch.nn.Module:
    """``args.steps`` flow-matching steps of a copy of ``transformer`` at σ in [low, high] (logit-normal mapped onto
    it); returns the EMA."""
    model = copy.deepcopy(transformer).train()
    ema = copy.deepcopy(transformer).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    g = torch.Generator().manual_seed(args.seed)  # batches, caption dropout, σ and noise of training
    train_rows = len(latents) - HELD_OUT
    start = time.time()
    for step in range(1, args.steps + 1):
        idx = torch.randint(train_rows, (args.batch_size,), generator=g)
        drop = torch.rand(args.batch_size, generator=g) < args.caption_dropout
        cond = Conditioning(encoder_hidden_states=states[torch.where(drop, len(states) - 1, idx)])
        sigma = sample_sigmas(args.batch_size, "logit_normal", g, low=low, high=high)
        noise = torch.randn(latents[idx].shape, generator=g)
        v = ADAPTERS["wan_t2v"].velocity(model, noised(latents[idx], noise, sigma), sigma * 1000, cond)
        loss = flow_matching_loss(v, latents[idx], noise)[0].mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema_update(ema, model, args.ema)
        if step % 100 == 0:
            print(f"{name}: step {step} loss {loss.item():.4f} ({time.time() - start:.0f}s)", flush=True)
    return ema


@torch.no_grad()
def range_loss(transformer: torch.nn.Module, latents: torch.Tensor, states: torch.Tensor, low: float,
               high: float) -> float:
    """Mean flow-matching loss of the held-out latents at 8 σ evenly inside [low, high], fixed noise."""
    g = torch.Generator().manual_seed(1)
    x0, cond = latents[-HELD_OUT:], Conditioning(encoder_hidden_states=states[len(latents) - HELD_OUT:len(latents)])
    losses = []
    for k in range(8):
        sigma = torch.full((len(x0),), low + (high - low) * (k + 0.5) / 8)
        noise = torch.randn(x0.shape, generator=g)
        v = ADAPTERS["wan_t2v"].velocity(transformer, noised(x0, noise, sigma), sigma * 1000, cond)
        losses.append(flow_matching_loss(v, x0, noise)[0].mean())
    return float(torch.stack(losses).mean())


@torch.no_grad()
def geneval(models: dict[str, torch.nn.Module], encoder, vae, boundary: float, args) -> dict[str, float]:
    """Synthetic GenEval (all four facts right) of 20-step ODE samples of 64 seen-concept prompts through the
    package's stage: one ``transformer``, or a pair ``transformer`` / ``transformer_2`` at ``boundary``."""
    data = ShapesDataset(64, 1, 8, 8, seed=2, exclude=PRETRAIN_EXCLUDE)
    pair = "transformer_2" in models
    scores = evaluate_generator(models["transformer"], encoder, ByT5Tokenizer(), vae,
                                [data[i]["prompt"] for i in range(len(data))], batch_size=16, seed=0,
                                frames=args.frames, height=args.size, width=args.size,
                                sampler=FlowMatchSampler(num_steps=20), text_max_length=args.text_max_length,
                                transformer_2=models.get("transformer_2"), boundary_ratio=boundary if pair else None)
    return {key: round(float(value), 3) for key, value in scores.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--boundary", type=float, default=0.875, help="boundary_ratio (Wan2.2-T2V-A14B's)")
    parser.add_argument("--steps", type=int, default=400, help="steps of each expert; the control trains twice as many")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--ema", type=float, default=0.99)
    parser.add_argument("--caption-dropout", type=float, default=0.1)
    parser.add_argument("--videos", type=int, default=4096, help="train_world.py's pretraining videos (cached)")
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--text-max-length", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="training draws (the shipped pair: 0); the held-out "
                        "measurement's noise stays fixed")
    parser.add_argument("--cache", default="runs/world/latents.safetensors")
    parser.add_argument("--out", default="runs/wan22")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    vae = build_model("wan_vae", pretrained=TRAINED_ASSETS["wan_vae"]).eval().requires_grad_(False)
    encoder = build_model("umt5", pretrained=TRAINED_ASSETS["umt5"]).eval().requires_grad_(False)
    world = build_model("wan_t2v", pretrained=TRAINED_ASSETS["wan_t2v"]).eval()
    latents, prompts = encoded_dataset(vae, args.videos, args.frames, args.size, args.cache)
    with torch.no_grad():  # the frozen encoder's states of every caption, the empty prompt last
        ids, mask = wan_tokens(ByT5Tokenizer(), prompts + [""], args.text_max_length)
        states = torch.cat([wan_text_states(encoder, ids[i:i + 256], mask[i:i + 256]) for i in range(0, len(ids), 256)])

    b = args.boundary
    ranges = {"high": (b, 1.0), "low": (0.0, b)}
    start = time.time()
    high = train(world, latents, states, *ranges["high"], args, "transformer (high noise)")
    low = train(world, latents, states, *ranges["low"], args, "transformer_2 (low noise)")
    control = train(world, latents, states, 0.0, 1.0, argparse.Namespace(**{**vars(args), "steps": 2 * args.steps}),
                    "control (all σ)")
    minutes = (time.time() - start) / 60
    measured = {"boundary_ratio": b, "seed": args.seed, "steps_each": args.steps, "control_steps": 2 * args.steps,
                "train_minutes": round(minutes, 1), "flow_matching_loss": {}, "geneval_seen_64": {}}
    for name, (lo, hi) in ranges.items():
        expert = high if name == "high" else low
        measured["flow_matching_loss"][f"{name} σ in [{lo}, {hi}]"] = {
            who: round(range_loss(model, latents, states, lo, hi), 5)
            for who, model in (("world", world), ("control", control), ("expert", expert))}
    for who, models in (("world", {"transformer": world}), ("control", {"transformer": control}),
                        ("pair", {"transformer": high, "transformer_2": low})):
        measured["geneval_seen_64"][who] = geneval(models, encoder, vae, b, args)
    print(json.dumps(measured, indent=1), flush=True)
    os.makedirs(args.out, exist_ok=True)
    high.save_pretrained(os.path.join(args.out, "transformer"), safe_serialization=True)
    low.save_pretrained(os.path.join(args.out, "transformer_2"), safe_serialization=True)
    with open(os.path.join(args.out, "measured.json"), "w") as f:
        json.dump(measured, f, indent=1)
    print(f"saved {args.out}/transformer and {args.out}/transformer_2", flush=True)


if __name__ == "__main__":
    main()
