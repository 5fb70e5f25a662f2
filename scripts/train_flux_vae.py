"""Train the FLUX stage's image VAE (``AutoencoderKL``, the ``vae_kl`` preset) on the synthetic world's frames.

FluxPipeline decodes 4-D latents with an ``AutoencoderKL`` (the Wan VAE is 5-D), so the text-to-image
generator gets its own image codec: 4x spatial compression (three levels), 16 latent channels, trained on
first frames of the world's videos with every concept (held-out ones included: a concept is held out of
the *generator's* pretraining, never out of the codec). L1 + MSE reconstruction and a tiny KL, as
``scripts/train_vae.py`` trains the world's video VAE. Every ``--eval-every`` steps it prints how well
held-out images' reconstructions read back (synthetic GenEval: shape, colour, background). At the end
the latent statistics become FLUX's ``shift_factor``/``scaling_factor`` (z ↦ (z - shift)·scale has zero
mean and unit variance), which ``modules/models/vae.py`` and FluxPipeline apply.

    python scripts/train_flux_vae.py --out modules/assets/vae_kl     # TIME on 2 CPU cores

Runs on 1 torch thread (the shared machine spins more with 2).
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL

from posttrain.datamodules.synthetic import ShapesDataset
from posttrain.modules.world.geneval import SyntheticGenEval
from posttrain.modules.models.presets import PRESETS

IMAGE_FACTS = ("shape", "colour", "background")


def image_prompt(prompt: str) -> str:
    """A caption without its motion ("a red circle on a blue background"): what one frame can show."""
    words = prompt.split()
    if "moving" in words:
        i = words.index("moving")
        words = words[:i] + words[i + 2:]
    return " ".join(words)


@torch.no_grad()
def image_geneval(images: torch.Tensor, prompts: list[str]) -> dict[str, float]:
    """Synthetic GenEval of (B, 3, H, W) images in [-1, 1] on the facts one frame shows."""
    metric = SyntheticGenEval()
    metric.update(images[:, :, None], [image_prompt(p) for p in prompts])
    scores = metric.compute()
    return {k: round(float(scores[k]), 3) for k in IMAGE_FACTS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000, help="optimizer steps (cosine decay to 0 over them)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--kl", type=float, default=1e-6, help="weight of the KL term")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--eval-images", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="modules/assets/vae_kl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    vae = AutoencoderKL(**PRESETS["vae_kl"])
    print(f"AutoencoderKL {sum(p.numel() for p in vae.parameters()) / 1e6:.3f}M parameters", flush=True)
    train = ShapesDataset(1_000_000, 1, args.size, args.size, seed=123)
    held = ShapesDataset(args.eval_images, 1, args.size, args.size, seed=999)
    held_images = torch.stack([held[i]["video"][:, 0] for i in range(len(held))])
    held_prompts = [held[i]["prompt"] for i in range(len(held))]

    opt = torch.optim.AdamW(vae.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / 100, 0.5 * (1 + math.cos(math.pi * min(s / args.steps, 1.0)))))
    g = torch.Generator().manual_seed(0)
    start, history = time.time(), []
    for step in range(1, args.steps + 1):
        idx = torch.randint(len(train), (args.batch_size,), generator=g).tolist()
        images = torch.stack([train[i]["video"][:, 0] for i in idx])  # (B, 3, H, W) in [-1, 1]
        dist = vae.encode(images).latent_dist
        recon = vae.decode(dist.sample(g)).sample
        rec = F.l1_loss(recon, images) + F.mse_loss(recon, images)  # L1 keeps edges sharp, MSE weighs colour
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
            with torch.no_grad():
                recon = vae.decode(vae.encode(held_images).latent_dist.mode()).sample.clamp(-1, 1)
            vae.train()
            history.append({"step": step, "seconds": round(time.time() - start), **image_geneval(recon, held_prompts)})
            print("geneval of reconstructions", json.dumps(history[-1]), flush=True)

    # FLUX normalizes latents with one shift and one scale (FluxPipeline: z / scaling_factor + shift_factor)
    vae.eval()
    with torch.no_grad():
        z = vae.encode(held_images).latent_dist.mode()
    vae.register_to_config(shift_factor=float(z.mean()), scaling_factor=float(1.0 / z.std()))
    vae.save_pretrained(args.out, safe_serialization=True)
    print(f"saved {args.out} after {args.steps} steps, {(time.time() - start) / 60:.1f} min; "
          f"last check {json.dumps(history[-1])}")


if __name__ == "__main__":
    main()
