"""The README's "Measured results of the default configs": each config validated before training (its
initial weights) and after ``posttrain fit`` (its last checkpoint), through the real command.

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
            before = metric(posttrain("validate", *run), METRICS[name])
            start = time.time()
            posttrain("fit", *run)
            seconds = time.time() - start
            after = metric(posttrain("validate", *run, "--ckpt_path", "last"), METRICS[name])
            rows.append((name, METRICS[name], before, after, seconds))
            print(f"{name:14s} {METRICS[name]:10s} {before:.3f} -> {after:.3f}  (fit {seconds:.0f} s)", flush=True)
    print("\n| config | metric | before | after | fit time |\n|---|---|---|---|---|")
    for name, key, before, after, seconds in rows:
        print(f"| `configs/{name}.yaml` | `{key}` | {before:.3f} | {after:.3f} | {seconds:.0f} s |")


if __name__ == "__main__":
    main()
