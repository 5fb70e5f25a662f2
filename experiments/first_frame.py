"""Why a Self-Forcing student with chunks of 1 latent frame draws a washed first frame: the statistics of the first
latent frame, the teacher's against the chunked student's, and what the codec makes of them.

    OMP_NUM_THREADS=1 python -m experiments.first_frame               # configs/self_forcing_long.yaml, untrained
    OMP_NUM_THREADS=1 python -m experiments.first_frame --prompts 8

The Wan codec's first latent frame encodes one image (the later ones four frames each), so it has channel statistics
of its own. Prints, over the prompts' samples (teacher: its sampler, CFG; student: the config's chunked sampler, the
teacher's weights before any training): per latent frame mean/std; the first latent frame's per-channel means beside
the teacher's first and fourth; the first pixel frame's mean RGB; and the first pixel frame when the student's first
latent frame is spliced into the teacher's clip (the same wash = the latent's, not the decoder's).
"""
from __future__ import annotations

import argparse
import tempfile

import torch

from bench.fewstep import bench_cli, held_out_prompts, samples


def rounded(values) -> list[float]:
    return [round(float(v), 2) for v in values]


def per_channel(latents: torch.Tensor, frame: int) -> list[float]:
    """(B, C, F, h, w) -> the mean of each channel of latent frame ``frame``."""
    return rounded(latents[:, :, frame].mean(dim=(0, 2, 3)))


def first(videos: torch.Tensor) -> list[float]:
    """(B, 3, F, H, W) -> the first pixel frame's mean RGB."""
    return rounded(videos[:, :, 0].mean(dim=(0, 2, 3)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/self_forcing_long.yaml")
    parser.add_argument("--prompts", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        cli = bench_cli(args.config, root, None)
    module, prompts = cli.model, held_out_prompts(cli, args.prompts)
    teacher_latents, teacher_videos = samples(module, prompts, module.teacher_sampler, "teacher", len(prompts))
    student_latents, student_videos = samples(module, prompts, module.sampler, "transformer", len(prompts))
    print(f"{len(prompts)} prompts; chunks of {module.sampler.chunk_frames} latent frame(s)")
    for name, latents in (("teacher", teacher_latents), ("student", student_latents)):
        frames = range(latents.shape[2])
        print(f"{name}: latent frame mean / std", [rounded((latents[:, :, f].mean(), latents[:, :, f].std()))
                                                   for f in frames])
    print("per-channel mean, teacher's first latent frame:", per_channel(teacher_latents, 0))
    print("per-channel mean, teacher's fourth latent frame:", per_channel(teacher_latents, 3))
    print("per-channel mean, student's first latent frame:", per_channel(student_latents, 0))
    print("first pixel frame, mean RGB in [-1, 1]: teacher", first(teacher_videos), "student", first(student_videos))
    spliced = teacher_latents.clone()
    spliced[:, :, 0] = student_latents[:, :, 0]
    print("the teacher's clip with the student's first latent frame: first pixel frame",
          first(module.stage.decode(spliced)))


if __name__ == "__main__":
    with torch.no_grad():
        main()
