"""How hard DMD2's GAN term pulls on the student's sample against DMD's, over a fit: ``train/gan_to_dmd_grad``
(the two terms' gradient norms at x̂0, weights included, read off the student's own backward; ``lit/dmd2.py``),
logged every iteration the student steps by ``posttrain fit`` with a CSV logger, summarised as its median per
quarter of the fit for each GAN weight asked, beside how well the head tells the teacher's samples from the
student's by the end (its mean probability on each). The baseline is the config's own weight, run in the same call.

    python -m experiments.gan_pull                            # configs/dmd2.yaml at its weight and 100× it
    python -m experiments.gan_pull --weights 3e-3 3e-2 3e-1 --steps 400 --students 1
    python -m experiments.gan_pull --weights 3e-3 --steps 2400 --model.init_args.gan.critic_weight 1.0  # head loss ×100
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import tempfile

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRIC = "train/gan_to_dmd_grad/transformer"
HEAD = ("train/gan_real_prob/critic", "train/gan_fake_prob/critic")  # the head's mean sigmoid on each, per iteration


def fit(config: str, root: str, steps: int, students: int, weight: float, extra: list[str]
        ) -> tuple[list[float], list[float], list[float]]:
    """One ``posttrain fit`` of ``config`` at GAN generator weight ``weight``: the ratio of each student step, and
    the head's mean probability on the teacher's (real) and the student's (fake) samples of each iteration."""
    command = ["posttrain", "fit", "--config", config,
               "--trainer.max_steps", str(steps), "--trainer.log_every_n_steps", "1",
               "--trainer.default_root_dir", root, "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
               "--trainer.logger.init_args.save_dir", root, "--trainer.callbacks", "[]",
               "--trainer.enable_checkpointing", "false", "--trainer.limit_val_batches", "0",
               "--model.init_args.student_steps", str(students),
               "--model.init_args.gan.generator_weight", str(weight), *extra]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"posttrain fit failed (weight {weight}):\n{done.stderr[-3000:]}")
    path = os.path.join(root, "lightning_logs", "version_0", "metrics.csv")
    with open(path) as f:  # a row per logging step; the rows after a student's iteration repeat its value
        rows = list(csv.DictReader(f))
    logged = [float(row[METRIC]) for row in rows if row.get(METRIC)]
    real, fake = ([float(row[key]) for row in rows if row.get(key)] for key in HEAD)
    return [v for i, v in enumerate(logged) if i == 0 or v != logged[i - 1]], real, fake


def last_quarter(values: list[float]) -> float:
    return statistics.median(values[3 * len(values) // 4:] or values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "dmd2.yaml"))
    parser.add_argument("--weights", type=float, nargs="+", default=None,
                        help="GAN generator weights (default: the config's and 100 times it)")
    parser.add_argument("--steps", type=int, default=400, help="fit iterations")
    parser.add_argument("--students", type=int, default=2, help="the student's steps")
    args, extra = parser.parse_known_args()  # the rest goes to the CLI, e.g. --model.init_args.gan.blocks [0,1]
    with open(args.config) as f:
        base = float(yaml.safe_load(f)["model"]["init_args"]["gan"]["generator_weight"])
    weights = args.weights or [base, 100 * base]
    print(f"{args.config}, {args.students}-step student, {args.steps} iterations; {METRIC}: median per quarter")
    print("| GAN generator weight | student steps | 1st quarter | 2nd | 3rd | 4th | against the config's weight "
          "| head's real / fake probability, last quarter |")
    print("|---|---|---|---|---|---|---|---|")
    first = None
    for weight in weights:
        with tempfile.TemporaryDirectory() as root:
            values, real, fake = fit(args.config, root, args.steps, args.students, weight, extra)
        bounds = [i * len(values) // 4 for i in range(5)]
        quarters = [f"{statistics.median(values[a:b]):.4f}" if b > a else "—" for a, b in zip(bounds, bounds[1:])]
        first = first or (weight, statistics.median(values))
        ratio = statistics.median(values) / first[1]
        print(f"| {weight:g} | {len(values)} | " + " | ".join(quarters) + f" | ×{ratio:.1f} (weight ×"
              f"{weight / first[0]:g}) | {last_quarter(real):.3f} / {last_quarter(fake):.3f} |", flush=True)


if __name__ == "__main__":
    main()
