"""DMD2 and Self-Forcing distillation: the few-step student's sampling time against the teacher's, and how close
its samples come to the teacher's many-step CFG samples, before and after ``fit``.

1. Time: one batch of the served student (the config's few-step sampler, no CFG) against the teacher's
   sampler (the config's ``teacher_sampler``: many steps with CFG, two forwards a step), VAE decoding
   included, alternated in blocks (``timing.py``); the ratio with its interval.
2. Closeness, on ``--prompts`` seen-concept synthetic captions with fixed seeds, each set against the teacher's
   many-step CFG samples of the same prompts and noise: the Fréchet VAE distance of the frames
   (``modules/frechet.py``), the latent MSE from the same noise, and synthetic GenEval of each set (the teacher's
   own is the target). Rows: the teacher run with the student's few steps (whole video at once), the student
   before training (it starts from the teacher's weights: for DMD2 the same samples as the row above, for
   Self-Forcing the teacher's weights run chunk by chunk with the KV cache) and after ``fit`` of the config in
   this process.

    python bench/distill.py                          # configs/dmd2.yaml, a few minutes on 2 CPU cores
    python bench/distill.py --config configs/self_forcing.yaml --grid docs/distill/self_forcing.png
    python bench/distill.py --steps 100 --prompts 32
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import compare, interleave  # noqa: E402

from posttrain.datamodules.synthetic import PRETRAIN_EXCLUDE, ShapesDataset  # noqa: E402
from posttrain.lit.tools.config import PosttrainCLI  # noqa: E402
from posttrain.modules.frechet import VideoFrechetDistance  # noqa: E402
from posttrain.modules.geneval import SyntheticGenEval  # noqa: E402
from posttrain.modules.media import grid  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@torch.no_grad()
def samples(module, prompts: list[str], sampler, name: str, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(latents, videos) of expert ``name`` with ``sampler`` (its CFG included), batch ``i`` from seed ``i``:
    the noise ``module.generate`` draws."""
    latents = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        g = torch.Generator().manual_seed(i // batch)
        noise = torch.randn((len(chunk), *module.stage.latent_shape(module.video)), generator=g)
        cond, uncond = module.conditioning(chunk, sampler)
        latents.append(module.stage.sample(sampler, noise, cond, uncond, name=name, rng=g).latents)
    latents = torch.cat(latents)
    return latents, module.stage.decode(latents)


def closeness(prompts, teacher: tuple[torch.Tensor, torch.Tensor], other: tuple[torch.Tensor, torch.Tensor]) -> dict:
    frechet = VideoFrechetDistance()
    frechet.update(teacher[1], real=True)
    frechet.update(other[1], real=False)
    geneval = SyntheticGenEval()
    geneval.update(other[1], prompts)
    return {"frechet": float(frechet.compute()), "latent_mse": float((other[0] - teacher[0]).pow(2).mean()),
            **{k: float(v) for k, v in geneval.compute().items()}}


def row(name: str, scores: dict) -> str:
    return (f"| {name} | {scores['frechet']:.3f} | {scores['latent_mse']:.4f} | {scores['all']:.3f} | "
            f"{scores['shape']:.2f} / {scores['colour']:.2f} / {scores['background']:.2f} / {scores['motion']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "dmd2.yaml"))
    parser.add_argument("--steps", type=int, default=None, help="fit iterations (default: the config's max_steps)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=5, help="timing blocks")
    parser.add_argument("--grid", default=None, help="write a PNG of the first 4 prompts' samples (every row) here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(sys, "argv", sys.argv[:1]):
        extra = ["--trainer.default_root_dir", tmp, "--trainer.logger", "false", "--trainer.enable_checkpointing",
                 "false", "--trainer.callbacks", "[]", "--trainer.limit_val_batches", "0"]
        if args.steps is not None:
            extra += ["--trainer.max_steps", str(args.steps)]
        cli = PosttrainCLI(args=["--config", args.config, *extra], run=False)
        module = cli.model
        module.configure_model()
        module.eval()
        student_sampler, teacher_sampler = module.sampler, module.teacher_sampler
        data = ShapesDataset(args.prompts, 1, 8, 8, seed=5, exclude=PRETRAIN_EXCLUDE)
        prompts = [data[i]["prompt"] for i in range(len(data))]

        # 1. sampling time of one batch
        one = prompts[:args.batch]
        blocks = interleave(lambda: samples(module, one, teacher_sampler, "teacher", args.batch),
                            lambda: samples(module, one, student_sampler, "transformer", args.batch),
                            blocks=args.blocks, per_block=1, names=("teacher", "student"))
        print(f"sampling {len(one)} videos of {module.video}: teacher {teacher_sampler.num_steps} steps with CFG "
              f"{teacher_sampler.guidance_scale} vs student {student_sampler.num_steps} steps")
        print(compare(blocks, per="batch", ratio_name="time student/teacher").report(), flush=True)

        # 2. closeness to the teacher's many-step CFG samples, before and after fit
        teacher = samples(module, prompts, teacher_sampler, "teacher", args.batch)
        target = SyntheticGenEval()
        target.update(teacher[1], prompts)
        target = {k: float(v) for k, v in target.compute().items()}
        # the rows: for a chunked (Self-Forcing) student, also the bidirectional teacher at the student's steps,
        # whole video in one pass; for DMD2 that is the student before training, sampled once
        shown = ("few", "before", "after") if student_sampler.chunk_frames else ("before", "after")
        sets = {"before": samples(module, prompts, student_sampler, "transformer", args.batch)}
        if "few" in shown:
            whole = copy.copy(student_sampler)
            whole.chunk_frames = None
            sets["few"] = samples(module, prompts, whole, "teacher", args.batch)
        module.train()
        cli.trainer.fit(module, datamodule=cli.datamodule)
        module.eval()
        sets["after"] = samples(module, prompts, student_sampler, "transformer", args.batch)
        scores = {k: closeness(prompts, teacher, sets[k]) for k in shown}
    steps = cli.trainer.global_step
    print(f"\n{len(prompts)} seen-concept prompts; reference: the teacher, {teacher_sampler.num_steps} steps, CFG "
          f"{teacher_sampler.guidance_scale} (its GenEval all {target['all']:.3f}; shape / colour / background / "
          f"motion {target['shape']:.2f} / {target['colour']:.2f} / {target['background']:.2f} / "
          f"{target['motion']:.2f})")
    print(f"\n| {student_sampler.num_steps}-step samples | Fréchet VAE distance to the teacher | latent MSE (same "
          f"noise) | GenEval all | shape / colour / background / motion |\n|---|---|---|---|---|")
    method = type(module).__name__
    if "few" in shown:
        print(row("teacher, whole video", scores["few"]))
        print(row(f"student before training (the teacher's weights, chunks of {student_sampler.chunk_frames} latent "
                  f"frame(s), KV cache)", scores["before"]))
    else:
        print(row("teacher = student before training", scores["before"]))
    print(row(f"student after {steps} iterations of {method}", scores["after"]))
    if args.grid:
        labels = {"few": f"teacher, {student_sampler.num_steps} steps", "before": "student before",
                  "after": f"student after {steps} iterations"}
        rows = []
        for i in range(min(4, len(prompts))):
            rows.append((f"{prompts[i][:60]}: teacher, {teacher_sampler.num_steps} steps, CFG", teacher[1][i]))
            rows += [(labels[k], sets[k][1][i]) for k in shown]
        grid(rows, scale=4).save(args.grid)
        print(f"\nsamples of the first {min(4, len(prompts))} prompts: {args.grid}")


if __name__ == "__main__":
    main()
