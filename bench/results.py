"""The README's "Measured results of the default configs": each config validated before training (its
initial weights) and after ``posttrain fit`` (its last checkpoint), through the real command, with
``configs/eval/geneval.yaml`` added to both validations (``val/eval/...``): synthetic GenEval of 64
seen-concept captions (per fact and all four together), a Fréchet VAE distance of those samples to the
data, and GenEval of 32 captions of the held-out concept (magenta).

    python bench/results.py                      # every default config (a few minutes on 2 CPU cores)
    python bench/results.py finetune flow_grpo   # some of them

Runs go to a temporary folder (W&B offline); the printed table is what the README quotes.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRICS = {"finetune": "val/loss", "flow_grpo": "val/reward", "diffusion_nft": "val/reward",
           "joint_rl": "val/reward", "unified_rl": "val/reward"}


def posttrain(*args: str) -> str:
    env = dict(os.environ, WANDB_MODE="offline", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-m", "posttrain", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"posttrain {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def metric(output: str, name: str) -> float:
    """``name`` from the table Lightning prints after ``validate``."""
    found = re.findall(rf"{re.escape(name)}\s*│?\s*([-+0-9.eE]+)", output)
    if not found:
        raise SystemExit(f"{name} not in the validate output:\n{output[-2000:]}")
    return float(found[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", default=list(METRICS))
    names = parser.parse_args().configs
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            config = os.path.join(ROOT, "configs", f"{name}.yaml")
            run = ["--config", config, f"--trainer.default_root_dir={os.path.join(tmp, name)}"]
            evaluate = ["--config", os.path.join(ROOT, "configs", "eval", "geneval.yaml")]
            before = scores(posttrain("validate", *run, *evaluate), METRICS[name])
            start = time.time()
            posttrain("fit", *run)
            seconds = time.time() - start
            after = scores(posttrain("validate", *run, *evaluate, "--ckpt_path", "last"), METRICS[name])
            rows.append((name, before, after, seconds))
            print(f"{name:14s} {METRICS[name]:10s} {before['own']:.3f} -> {after['own']:.3f}  GenEval all "
                  f"{before['eval/seen/all']:.3f} -> {after['eval/seen/all']:.3f}  held-out all "
                  f"{before['eval/held_out/all']:.3f} -> {after['eval/held_out/all']:.3f}  (fit {seconds:.0f} s)",
                  flush=True)
    print("\n| config | own metric | GenEval all (seen) | shape | colour | background | motion | held-out concept all "
          "| held-out colour | Fréchet VAE dist. | fit time |\n|---|---|---|---|---|---|---|---|---|---|---|")
    arrow = lambda b, a, key: f"{b[key]:.3f} → {a[key]:.3f}"
    for name, b, a, seconds in rows:
        print(f"| `configs/{name}.yaml` | `{METRICS[name]}` {arrow(b, a, 'own')} | {arrow(b, a, 'eval/seen/all')} | "
              + " | ".join(arrow(b, a, f"eval/seen/{fact}") for fact in ("shape", "colour", "background", "motion"))
              + f" | {arrow(b, a, 'eval/held_out/all')} | {arrow(b, a, 'eval/held_out/colour')} | "
              f"{arrow(b, a, 'eval/seen/frechet')} | {seconds:.0f} s |")


def scores(output: str, own: str) -> dict[str, float]:
    """The config's own metric and the evaluation's, from one ``validate`` output."""
    keys = [f"eval/seen/{k}" for k in ("all", "shape", "colour", "background", "motion", "frechet")] + \
        ["eval/held_out/all", "eval/held_out/colour"]
    return {"own": metric(output, own), **{key: metric(output, f"val/{key}") for key in keys}}


if __name__ == "__main__":
    main()
