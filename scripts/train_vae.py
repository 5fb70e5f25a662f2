"""Train the world's VAE (a real ``AutoencoderKLWan``) on the synthetic shape videos; save it as an asset.

The VAE is the codec every generator of the embedded default is read through, so it sees the whole
world (every colour, shape and motion, held-out concepts included): a concept is held out of the
*generator's* pretraining, never out of the codec. Its spatial compression is 4x (three ``dim_mult``
levels; the 8x VAE of earlier versions turned every 32 px shape into a blob), its temporal compression
Wan's 4x (frames = 4k+1). It is trained until its reconstructions read back every fact
(``modules/geneval.py``); the script stops early once they read back ``--target`` per fact on
``--eval-videos`` held-out videos at two checks in a row, and prints the figures.

    python scripts/train_vae.py --out modules/assets/wan_vae     # TIME on 2 CPU cores

Runs on 2 torch threads; the time above was measured on this repository's shared 2-core machine.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan

from posttrain.datamodules.synthetic import ShapesDataset
from posttrain.modules.geneval import SyntheticGenEval
from posttrain.modules.presets import PRESETS


def reconstruction_geneval(vae: AutoencoderKLWan, videos: torch.Tensor, prompts: list[str]) -> dict[str, float]:
    metric = SyntheticGenEval()
    with torch.no_grad():
        for i in range(0, len(videos), 16):
            z = vae.encode(videos[i:i + 16]).latent_dist.mode()
            metric.update(vae.decode(z).sample.clamp(-1, 1), prompts[i:i + 16])
    return {k: round(float(v), 3) for k, v in metric.compute().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4000, help="at most this many optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--kl", type=float, default=1e-6, help="weight of the KL term")
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--size", type=int, default=32, help="height = width of the world's videos, in pixels")
    parser.add_argument("--crop", type=int, default=16, help="train on random crops this size (the VAE is "
                        "convolutional and the world a torus, so any crop is a valid clip; 4x fewer pixels)")
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--eval-videos", type=int, default=96)
    parser.add_argument("--target", type=float, default=0.98, help="stop once every fact reads back this well")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="modules/assets/wan_vae")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**PRESETS["wan_vae"])
    print(f"AutoencoderKLWan {sum(p.numel() for p in vae.parameters()) / 1e6:.3f}M parameters", flush=True)
    train = ShapesDataset(1_000_000, args.frames, args.size, args.size, seed=123)
    held = ShapesDataset(args.eval_videos, args.frames, args.size, args.size, seed=999)
    held_videos = torch.stack([held[i]["video"] for i in range(len(held))])
    held_prompts = [held[i]["prompt"] for i in range(len(held))]

    opt = torch.optim.AdamW(vae.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
    g = torch.Generator().manual_seed(0)
    start, passed = time.time(), 0
    history = []
    for step in range(1, args.steps + 1):
        idx = torch.randint(len(train), (args.batch_size,), generator=g).tolist()
        video = torch.stack([train[i]["video"] for i in idx])  # (B, 3, F, H, W) in [-1, 1]
        top, left = torch.randint(args.size - args.crop + 1, (2,), generator=g).tolist()
        video = video[..., top:top + args.crop, left:left + args.crop]
        dist = vae.encode(video).latent_dist
        recon = vae.decode(dist.sample(g)).sample
        # L1 keeps edges sharp where MSE alone settles for a blur; MSE weighs the colour error
        rec = F.l1_loss(recon, video) + F.mse_loss(recon, video)
        kl = dist.kl().mean()
        loss = rec + args.kl * kl
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0:
            print(f"step {step} rec {rec.item():.4f} kl {kl.item():.1f} ({time.time() - start:.0f}s)", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            vae.eval()
            scores = reconstruction_geneval(vae, held_videos, held_prompts)
            vae.train()
            history.append({"step": step, "seconds": round(time.time() - start), **scores})
            print("geneval of reconstructions", json.dumps(history[-1]), flush=True)
            passed = passed + 1 if min(scores[f] for f in ("shape", "colour", "background", "motion")) >= args.target else 0
            if passed >= 2:
                break

    # Per-channel latent statistics, as the real Wan VAE's config carries them (modules/vae.py normalizes).
    vae.eval()
    with torch.no_grad():
        z = vae.encode(held_videos[:64]).latent_dist.mode()
    vae.register_to_config(latents_mean=z.mean(dim=(0, 2, 3, 4)).tolist(),
                           latents_std=z.std(dim=(0, 2, 3, 4)).clamp_min(1e-3).tolist())
    vae.save_pretrained(args.out, safe_serialization=True)
    print(f"saved {args.out} after {step} steps, {time.time() - start:.0f}s; last check {json.dumps(history[-1])}")


if __name__ == "__main__":
    main()
