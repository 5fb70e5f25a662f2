"""Train the world's VAE (a real ``AutoencoderKLWan``) on the synthetic shape videos; save it as an asset.

The VAE is the codec every generator of the embedded default is read through, so it sees the whole
world (every colour, shape and motion, held-out concepts included): a concept is held out of the
*generator's* pretraining, never out of the codec. Its spatial compression is 4x (three ``dim_mult``
levels; the 8x VAE of earlier versions turned every 32 px shape into a blob), its temporal compression
Wan's 4x (frames = 4k+1). Two stages, each on random 16x16 crops (the VAE is convolutional and the
world a torus, so a crop is a valid clip with 4x fewer pixels), cosine learning rate:

1. ``codec``: encoder and decoder (the preset: width 16 both) together, L1 + MSE + a tiny KL.
   This fixes the latent space the generator is trained in. Its reconstructions round the corners of
   squares (shape read back 0.93-0.96).
2. ``decoder``: the encoder frozen, a wider decoder (``--decoder-base-dim``, 2x) trained from scratch on
   it, as Stable Diffusion's ft-MSE VAE finetuned only its decoder. The latents do not change, so the
   generator can train on stage 1's encoder while this stage runs.

The shipped ``modules/assets/wan_vae`` is a single codec stage of 4000 steps (20 min on the shared
2-core machine; reconstructions of 96 held-out videos read back shape 0.958, colour, background and
motion 1.0), made by this script as it was at commit bd7821a (constant learning rate after warm-up;
``git show bd7821a:scripts/train_vae.py``); its config's ``scale_factor_spatial`` was corrected to 4
by hand (that version left diffusers' default 8; the architecture is 4x). ``--stage codec --steps 4000``
of this version trains the same architecture with a cosine schedule. The decoder stage (10000 + 5000
steps) read back shape 0.927 and is not shipped: the world's generator and Wan I2V were trained in
the shipped codec's latent space, and a VAE from another run does not decode them.

3. ``long-decoder``: the shipped codec's own decoder finetuned on longer clips (``--frames 21 --speed 0.0625``: the
   long world's), its encoder frozen and its latent statistics kept, so the latents of every clip — and the long
   world's generator trained on them — stay as they are. The shipped codec, trained on 5-frame clips, encodes
   21-frame clips well but decodes only their first 5 frames: reconstructions of held-out 21-frame clips read back
   all four facts in 0.95 of the windows of frames 0-4 and in 0.17 / 0.02 / 0.03 / 0.05 of the later windows
   (4-8 ... 16-20). ``modules/assets/world21/wan_vae`` is

       python scripts/train_vae.py --stage long-decoder --codec modules/assets/wan_vae --frames 21 --speed 0.0625 \
           --steps 8000 --lr 5e-4 --eval-every 1000 --eval-videos 64 --out modules/assets/world21/wan_vae

   (37.5 min on one thread beside another job): windows 0.94 / 0.89 / 0.89 / 0.98 / 0.95, the whole clip 0.94.

4. ``--arch wan22_vae``: the world's Wan 2.2 VAE (the TI2V family's: residual blocks, 2x2 pixel patches, 48 latent
   channels, 8x spatial). ``modules/assets/wan22_vae`` is its codec stage, then a decoder of twice the width on the
   frozen encoder (the published VAE's decoder is wider than its encoder too), on whole 32 px frames (at 8x a 16 px
   crop is 2 x 2 latents: after 4000 steps it read back shape 0.34, colour 0.55), each on one thread beside another job:

       python scripts/train_vae.py --arch wan22_vae --stage codec --steps 6000 --crop 32 --eval-every 500 \
           --out runs/ti2v/wan22_vae_c32                                  # 8.7 min: shape 0.47, the rest 1.0
       python scripts/train_vae.py --arch wan22_vae --stage decoder --codec runs/ti2v/wan22_vae_c32 \
           --decoder-base-dim 32 --steps 6000 --crop 32 --eval-every 1000 --out modules/assets/wan22_vae
                                                                          # 14.7 min: shape 0.85, the rest 1.0

   The codec's narrow decoder rounds every corner (shape read back 0.47); the wider one reads back 0.85. The TI2V
   generator (``scripts/train_ti2v.py``) trains on the codec's latents, which the decoder stage leaves as they are.

Every ``--eval-every`` steps it prints how well ``--eval-videos`` held-out videos' reconstructions read
back (``modules/world/geneval.py``).

    python scripts/train_vae.py --out modules/assets/wan_vae     # TIME on 2 CPU cores
    python scripts/train_vae.py --stage decoder --codec runs/vae_codec --out modules/assets/wan_vae

Runs on 1 torch thread; the times were measured on this repository's shared 2-core machine.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan

from posttrain.datamodules.synthetic import ShapesDataset
from posttrain.modules.world.geneval import SyntheticGenEval, windows
from posttrain.modules.models.presets import PRESETS


def held_out(args) -> tuple[torch.Tensor, list[str]]:
    """The ``--eval-videos`` held-out videos (seed 999, never trained on) and their prompts."""
    held = ShapesDataset(args.eval_videos, args.frames, args.size, args.size, seed=999, speed=args.speed)
    return torch.stack([held[i]["video"] for i in range(len(held))]), [held[i]["prompt"] for i in range(len(held))]


@torch.no_grad()
def reconstruct(vae: AutoencoderKLWan, videos: torch.Tensor) -> torch.Tensor:
    return torch.cat([vae.decode(vae.encode(videos[i:i + 16]).latent_dist.mode()).sample.clamp(-1, 1)
                      for i in range(0, len(videos), 16)])


def reconstruction_geneval(vae: AutoencoderKLWan, videos: torch.Tensor, prompts: list[str]) -> dict[str, float]:
    metric = SyntheticGenEval()
    metric.update(reconstruct(vae, videos), prompts)
    return {k: round(float(v), 3) for k, v in metric.compute().items()}


def reconstruction_windows(vae: AutoencoderKLWan, videos: torch.Tensor, prompts: list[str]) -> dict[str, float]:
    """Synthetic GenEval all-four of the reconstructions per 5-frame window (frames 4(p-1) .. 4p,
    ``modules.geneval.windows``): where in a long clip the codec loses the facts."""
    out = {}
    for p, window in enumerate(windows(reconstruct(vae, videos)), start=1):
        metric = SyntheticGenEval()
        metric.update(window, prompts)
        out[f"frames {4 * (p - 1)}-{4 * p}"] = round(float(metric.compute()["all"]), 3)
    return out


def train(vae: AutoencoderKLWan, params: list[torch.nn.Parameter], args, label: str, restat: bool = True
          ) -> list[dict]:
    """``args.steps`` AdamW steps on ``params`` (the rest of the VAE stays as it is), with checks; with
    ``restat`` the latents' per-channel statistics are measured again (a frozen encoder keeps its own)."""
    train_data = ShapesDataset(1_000_000, args.frames, args.size, args.size, seed=123, speed=args.speed)
    held_videos, held_prompts = held_out(args)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    # linear warm-up, then cosine decay to 0: the last, small steps are what sharpen the edges
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / 100, 0.5 * (1 + math.cos(math.pi * min(s / args.steps, 1.0)))))
    g = torch.Generator().manual_seed(0)
    start, history = time.time(), []
    for step in range(1, args.steps + 1):
        idx = torch.randint(len(train_data), (args.batch_size,), generator=g).tolist()
        video = torch.stack([train_data[i]["video"] for i in idx])  # (B, 3, F, H, W) in [-1, 1]
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
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0:
            print(f"{label} step {step} rec {rec.item():.4f} kl {kl.item():.1f} ({time.time() - start:.0f}s)",
                  flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            vae.eval()
            scores = reconstruction_geneval(vae, held_videos, held_prompts)
            vae.train()
            history.append({"stage": label, "step": step, "seconds": round(time.time() - start), **scores})
            print("geneval of reconstructions", json.dumps(history[-1]), flush=True)
    vae.eval()
    if not restat:
        return history
    # Per-channel latent statistics, as the real Wan VAE's config carries them (modules/models/vae.py normalizes).
    with torch.no_grad():
        z = vae.encode(held_videos[:64]).latent_dist.mode()
    vae.register_to_config(latents_mean=z.mean(dim=(0, 2, 3, 4)).tolist(),
                           latents_std=z.std(dim=(0, 2, 3, 4)).clamp_min(1e-3).tolist())
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=["both", "codec", "decoder", "long-decoder"], default="both")
    parser.add_argument("--arch", choices=["wan_vae", "wan22_vae"], default="wan_vae",
                        help="the preset to train: the world's Wan 2.1 VAE or its Wan 2.2 (TI2V) VAE")
    parser.add_argument("--codec", help="stage 1's folder, for --stage decoder and long-decoder")
    parser.add_argument("--steps", type=int, default=10000, help="optimizer steps per stage (cosine decay to 0)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--kl", type=float, default=1e-6, help="weight of the KL term")
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--speed", type=float, default=None,
                        help="how far the shape moves per frame step (0.0625: the 5-frame world's pace continued "
                             "over a longer clip, as scripts/train_world.py --speed); unset: 0.25 over the clip")
    parser.add_argument("--size", type=int, default=32, help="height = width of the world's videos, in pixels")
    parser.add_argument("--crop", type=int, default=16, help="train on random crops this size")
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--eval-videos", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (on a shared machine more spin)")
    parser.add_argument("--decoder-base-dim", type=int, default=32, help="width of stage 2's decoder")
    parser.add_argument("--out", default="modules/assets/wan_vae")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.stage in ("decoder", "long-decoder") and not args.codec:
        parser.error(f"--stage {args.stage} needs --codec <a VAE folder>")

    # long clips: the codec's own decoder, finetuned on longer clips on its frozen encoder (the latents, and so
    # every generator trained on them, stay as they are)
    if args.stage == "long-decoder":
        vae = AutoencoderKLWan.from_pretrained(args.codec, local_files_only=True)
        vae.encoder.requires_grad_(False)
        vae.quant_conv.requires_grad_(False)
        params = list(vae.decoder.parameters()) + list(vae.post_quant_conv.parameters())
        held_videos, held_prompts = held_out(args)
        vae.eval()
        print("before:", json.dumps(reconstruction_windows(vae, held_videos, held_prompts)), flush=True)
        vae.train()
        train(vae, params, args, "long-decoder", restat=False)
        print("after:", json.dumps(reconstruction_windows(vae, held_videos, held_prompts)), flush=True)
        vae.save_pretrained(args.out, safe_serialization=True)
        print(f"saved {args.out}")
        return

    # 1. codec: encoder + narrow decoder
    if args.stage in ("both", "codec"):
        torch.manual_seed(0)
        # the decoder as wide as the encoder (a preset's wider decoder is stage 2's)
        codec = AutoencoderKLWan(**{**PRESETS[args.arch], "decoder_base_dim": None})
        print(f"stage 1: AutoencoderKLWan {sum(p.numel() for p in codec.parameters()) / 1e6:.3f}M parameters")
        train(codec, list(codec.parameters()), args, "codec")
        if args.stage == "codec":
            codec.save_pretrained(args.out, safe_serialization=True)
            print(f"saved {args.out}")
            return
    else:
        codec = AutoencoderKLWan.from_pretrained(args.codec, local_files_only=True)
    # 2. decoder: a wider decoder, trained from scratch on the frozen encoder
    torch.manual_seed(1)
    vae = AutoencoderKLWan(**{**PRESETS[args.arch], "decoder_base_dim": args.decoder_base_dim})
    frozen = {k: v for k, v in codec.state_dict().items() if k.startswith(("encoder.", "quant_conv."))}
    missing = vae.load_state_dict(frozen, strict=False).missing_keys
    assert all(k.startswith(("decoder.", "post_quant_conv.")) for k in missing), missing
    vae.encoder.requires_grad_(False)
    vae.quant_conv.requires_grad_(False)
    params = list(vae.decoder.parameters()) + list(vae.post_quant_conv.parameters())
    print(f"stage 2: decoder {sum(p.numel() for p in params) / 1e6:.3f}M parameters on the frozen encoder")
    history = train(vae, params, args, "decoder")
    vae.save_pretrained(args.out, safe_serialization=True)
    print(f"saved {args.out}; last check {json.dumps(history[-1])}")


if __name__ == "__main__":
    main()
