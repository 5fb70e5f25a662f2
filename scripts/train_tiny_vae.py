"""Train the tiny AutoencoderKLWan preset on the synthetic shape videos and save it as a package asset.

The random tiny VAE decodes every latent to nearly the same colour, so no reward computed on decoded
pixels can move. Trained for a few minutes on the procedurally generated data (no download), it
reconstructs colours and shapes, and RL rewards on pixels respond to the generator.

    python scripts/train_tiny_vae.py --steps 1500 --out modules/assets/tiny_wan_vae
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from posttrain.datamodules.synthetic import ShapesDataset  # noqa: E402
from posttrain.modules.presets import PRESETS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--kl", type=float, default=1e-6)
    parser.add_argument("--out", default="modules/assets/tiny_wan_vae")
    args = parser.parse_args()
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**PRESETS["wan_vae"])
    # two sizes, so the weights serve both the RL default (5x16x16) and the finetune default (9x32x32)
    sizes = [ShapesDataset(4096, frames=5, height=16, width=16, seed=123),
             ShapesDataset(4096, frames=9, height=32, width=32, seed=321)]
    opt = torch.optim.AdamW(vae.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps)
    g = torch.Generator().manual_seed(0)
    start = time.time()
    for step in range(args.steps):
        data = sizes[step % 2]
        idx = torch.randint(len(data), (args.batch_size,), generator=g).tolist()
        video = torch.stack([data[i]["video"] for i in idx])
        dist = vae.encode(video).latent_dist
        z = dist.sample(g)
        recon = vae.decode(z).sample
        rec = (recon - video).pow(2).mean()
        kl = dist.kl().mean()
        loss = rec + args.kl * kl
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step} recon {rec.item():.4f} kl {kl.item():.1f} ({time.time() - start:.0f}s)", flush=True)
    # per-channel latent statistics, as the real Wan VAE config carries them
    with torch.no_grad():
        video = torch.stack([sizes[1][i]["video"] for i in range(64)])
        z = vae.encode(video).latent_dist.mode()
        mean = z.mean(dim=(0, 2, 3, 4))
        std = z.std(dim=(0, 2, 3, 4)).clamp_min(1e-3)
    vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
    vae.save_pretrained(args.out, safe_serialization=True)
    print("saved", args.out)


if __name__ == "__main__":
    main()
