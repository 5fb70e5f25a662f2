"""Decoding a batch of latents with the shipped Wan VAE: its weights as stored against ``channels_last: true``.

The Wan codec normalises its activations over channels (diffusers' ``WanRMS_norm``: ``F.normalize`` over dim 1 of a
(B, C, F, H, W) tensor), a strided reduction when channels are the outer dimension; channels-last weights make the
convolutions write channels-last activations, so that reduction and the convolutions themselves run on contiguous
channels. Both decode the same latents (the world's 5-frame clip, 2 latent frames of 8×8) in alternating blocks
(bench/timing.py); the largest pixel difference and a profile of the stored layout's top operators are printed.

    OMP_NUM_THREADS=1 python -m bench.decode                 # batch 8, experiments/distill.py's timing batch
    OMP_NUM_THREADS=1 python -m bench.decode --batch 64
"""
from __future__ import annotations

import argparse

import torch

from bench.timing import compare, interleave
from posttrain.modules.models import vae as codec
from posttrain.modules.models.cards import Expert, ModelCard


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--per-block", type=int, default=3)
    parser.add_argument("--latent-frames", type=int, default=2)
    parser.add_argument("--size", type=int, default=8, help="latent height = width")
    args = parser.parse_args()
    card = ModelCard({"stored": Expert(arch="wan_vae"), "channels_last": Expert(arch="wan_vae", channels_last=True)})
    card.build()
    stored, fast = card.models["stored"].eval(), card.models["channels_last"].eval()
    latents = torch.randn(args.batch, stored.config.z_dim, args.latent_frames, args.size, args.size,
                          generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        difference = (codec.decode(fast, latents) - codec.decode(stored, latents)).abs().max().item()
        with torch.profiler.profile() as profile:
            codec.decode(stored, latents)
        timed = interleave(lambda: codec.decode(stored, latents), lambda: codec.decode(fast, latents),
                           blocks=args.blocks, per_block=args.per_block, names=("stored", "channels_last"))
    print(f"decoding {args.batch} latents of {tuple(latents.shape[1:])} with the shipped wan_vae, torch threads "
          f"{torch.get_num_threads()}; largest pixel difference {difference:.1e}")
    print("the stored layout's top operators (self CPU):")
    print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=4))
    print(compare(timed, per="batch", ratio_name="channels_last / stored").report())


if __name__ == "__main__":
    main()
