"""The default configs' learning figures (docs/results.md): each config validated before training (its
initial weights) and after ``posttrain fit`` (its last checkpoint), through the real command, with
``configs/eval/geneval.yaml`` added to both validations (``val/eval/...``): synthetic GenEval of 64
seen-concept captions (per fact and all four together), a Fréchet VAE distance of those samples to the
data, and GenEval of 32 captions of the held-out concept (magenta).

    python -m experiments.results                                   # every default config, seed 0
    python -m experiments.results finetune flow_grpo                # some of them
    python -m experiments.results finetune --seeds 0 1 2 --control  # 3 seeds: mean [min, max], and a zero-lr control

``--seeds`` trains once per seed, the seed set on all three RNGs of a run: ``seed_everything`` (global),
``data.init_args.seed`` (data content and order) and ``model.init_args.run.seed`` (the method's noise); a
cell reads ``before → mean [min, max]``. The evaluation's captions and noise seeds are the Evaluate
callback's own (``configs/eval/geneval.yaml``) and the initial weights are the config's, so "before" is one
validation, the same for every seed. ``--control`` adds one run of the first seed with every optimizer's
learning rate set to 0 (the same data, noise and evaluation; nothing may move): its "after" is the column
a gain is read against. Runs go to a temporary folder (W&B offline); the printed table is what docs/results.md quotes.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from statistics import mean

from bench.seeds import cell, seed_overrides, zero_lr_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRICS = {"finetune": "val/loss", "flow_grpo": "val/reward", "diffusion_nft": "val/reward",
           "joint_rl": "val/reward", "unified_rl": "val/reward"}
FACTS = ("shape", "colour", "background", "motion")
KEYS = [f"eval/seen/{k}" for k in ("all", *FACTS, "frechet")] + ["eval/held_out/all", "eval/held_out/colour"]


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


def scores(output: str, own: str) -> dict[str, float]:
    """The config's own metric and the evaluation's, from one ``validate`` output."""
    return {"own": metric(output, own), **{key: metric(output, f"val/{key}") for key in KEYS}}


def train_and_score(name: str, run: list[str], evaluate: list[str], extra: list[str]) -> tuple[dict, float]:
    start = time.time()
    posttrain("fit", *run, *extra)
    seconds = time.time() - start
    return scores(posttrain("validate", *run, *extra, *evaluate, "--ckpt_path", "last"), METRICS[name]), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", default=list(METRICS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="train once per seed (default: 0)")
    parser.add_argument("--control", action="store_true", help="add a zero-learning-rate run of the first seed")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            config = os.path.join(ROOT, "configs", f"{name}.yaml")
            run = ["--config", config]
            evaluate = ["--config", os.path.join(ROOT, "configs", "eval", "geneval.yaml")]
            root = lambda tag: [f"--trainer.default_root_dir={os.path.join(tmp, name, tag)}"]
            before = scores(posttrain("validate", *run, *root("before"), *evaluate), METRICS[name])
            afters, seconds = [], []
            for seed in args.seeds:
                after, took = train_and_score(name, run + root(f"seed{seed}"), evaluate, seed_overrides(seed))
                afters.append(after)
                seconds.append(took)
                print(f"{name:14s} seed {seed}: {METRICS[name]} {before['own']:.3f} -> {after['own']:.3f}  GenEval "
                      f"all {before['eval/seen/all']:.3f} -> {after['eval/seen/all']:.3f}  held-out all "
                      f"{before['eval/held_out/all']:.3f} -> {after['eval/held_out/all']:.3f}  (fit {took:.0f} s)",
                      flush=True)
            control = None
            if args.control:
                control, _ = train_and_score(name, run + root("control"), evaluate,
                                             seed_overrides(args.seeds[0]) + zero_lr_overrides(config))
                print(f"{name:14s} zero-lr control: GenEval all {control['eval/seen/all']:.3f}  held-out all "
                      f"{control['eval/held_out/all']:.3f}", flush=True)
            rows.append((name, before, afters, control, seconds))
    seeds = f"seeds {', '.join(map(str, args.seeds))}: mean [min, max]" if len(args.seeds) > 1 else \
        f"seed {args.seeds[0]}"
    print(f"\n({seeds}{'; zero-lr control: seen all / held-out all after its fit' if args.control else ''})")
    print("| config | own metric | GenEval all (seen) | shape | colour | background | motion | held-out concept all "
          f"| held-out colour | Fréchet VAE dist. |{' zero-lr control |' if args.control else ''} fit time |\n"
          f"|---|---|---|---|---|---|---|---|---|---|{'---|' if args.control else ''}---|")
    for name, before, afters, control, seconds in rows:
        cells = [cell(before[key], [a[key] for a in afters]) for key in ["own", *KEYS[:5], *KEYS[6:], KEYS[5]]]
        if control is not None:
            cells.append(f"{control['eval/seen/all']:.3f} / {control['eval/held_out/all']:.3f}")
        took = f"{mean(seconds):.0f} s" if len(seconds) == 1 else f"{mean(seconds):.0f} s [{min(seconds):.0f}, " \
            f"{max(seconds):.0f}]"
        print(f"| `configs/{name}.yaml` | `{METRICS[name]}` " + " | ".join(cells) + f" | {took} |")


if __name__ == "__main__":
    main()
