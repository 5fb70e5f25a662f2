"""RL on the world's captions, over seeds and against a zero-learning-rate control.

For a config (``flow_grpo``, ``diffusion_nft``), every seed s trains the shipped pretrained generator with
``seed_everything``, the data's and the method's seeds all set to s (the real ``fit`` of the config, its
validations included, W&B offline, checkpoints in a temporary folder), and the control trains the first seed at
learning rate 0 (``--control-steps`` shortens it: at lr 0 nothing moves, so its "after" is its "before" at any
length). Before and after, the serving generator (the config's ``sampler``: ODE, its steps, its CFG) samples
128 evaluation captions of seen concepts drawn by a seed training never uses, from noise seeds training never
uses, and is scored by synthetic GenEval (each fact, all four) and the Fréchet VAE distance of those samples to
the rendered captions; all four is also given on the evaluation captions that no training caption equals
(``unseen``: the world has 240 seen-concept captions, so a training set of 256 draws holds about two thirds). The
training reward (first and last tenth of its curve) stands beside them, and a Markdown table of it all (mean
[min, max] over the seeds, the control) is printed last. ``--sheet`` writes a matplotlib PNG of the first seed's
evaluation captions whose all-four verdict training changed, before and after.

    OMP_NUM_THREADS=1 python -m experiments.rl_captions diffusion_nft --control --sheet docs/rl/diffusion_nft.png
    python -m experiments.rl_captions flow_grpo --seeds 0 --at 100 200 --set trainer.max_steps=300  # a curve, overrides

The fit's wall and CPU seconds are printed per run (the budget is CPU-bound: on 2 idle cores the wall time of a
one-thread run is about its CPU time).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Optional

import torch
from lightning.pytorch import Callback

from bench.sheet import sheet
from posttrain.datamodules.synthetic import ShapesDataset
from posttrain.lit.tools.config import PosttrainCLI
from posttrain.modules.eval.frechet import VideoFrechetDistance
from posttrain.modules.world.geneval import judge
from posttrain.modules.world.world import FACTS, caption

EVAL_SEED = 4242  # caption seed of the evaluation (training draws captions with its data seed 0, 1, 2, ...)
NOISE_SEED = 770_000  # first noise seed of the evaluation (training noise comes from the method's own generator)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = FACTS + ("all", "unseen", "frechet")


def build(config: str, root: str, overrides: list[str]) -> PosttrainCLI:
    args = ["--config", os.path.join(ROOT, "configs", f"{config}.yaml"), f"--trainer.default_root_dir={root}",
            "--trainer.logger.init_args.offline=true", "--trainer.enable_progress_bar=false",
            "--trainer.log_every_n_steps=1"]
    return PosttrainCLI(args=args + [f"--{o}" for o in overrides], run=False)


@torch.no_grad()
def evaluate(model, prompts: list[str], real: torch.Tensor, trained: set[str], batch_size: int = 16) -> tuple:
    """Scores of the serving generator's samples of ``prompts`` (see the module docstring), and the videos."""
    model.configure_model()
    was_training = model.training
    model.eval()
    verdicts, videos = {f: [] for f in FACTS}, []
    frechet = VideoFrechetDistance()
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        out = model.generate(batch, seed=NOISE_SEED + start).float().clamp(-1, 1)
        for fact, v in judge(out, batch).items():
            verdicts[fact].append(v.cpu())
        frechet.update(real[start:start + batch_size], real=True)
        frechet.update(out, real=False)
        videos.append(out.cpu())
    model.train(was_training)
    table = torch.stack([torch.cat(verdicts[f]) for f in FACTS], 1)  # (N, 4), captions name all four
    shown = (table == 1).all(1).float()
    unseen = torch.tensor([p not in trained for p in prompts])
    scores = {f: table[:, i].mean().item() for i, f in enumerate(FACTS)}
    scores.update(all=shown.mean().item(), unseen=shown[unseen].mean().item() if unseen.any() else float("nan"),
                  frechet=frechet.compute().item(), n_unseen=int(unseen.sum()))
    return scores, torch.cat(videos)


class Rewards(Callback):
    """The training reward of every iteration (``train/reward``, logged every iteration here: Lightning hands it
    to ``callback_metrics`` after the iteration's callbacks ran, so it is read at the next one's start)."""

    def __init__(self):
        self.values: dict[str, list[float]] = {}

    def read(self, trainer) -> None:
        for key, value in trainer.callback_metrics.items():
            if key == "train/reward" or key.startswith(("train/reward/", "train/kept_samples/", "train/clip_frac/")):
                self.values.setdefault(key, []).append(float(value))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.read(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self.read(trainer)


class Midway(Callback):
    """Scores of the evaluation at the given iterations during the fit (a learning curve for tuning; the noise
    of the evaluation is its own, the training's generators are not touched)."""

    def __init__(self, at: list[int], prompts, real, trained):
        self.at, self.prompts, self.real, self.trained, self.scores = set(at), prompts, real, trained, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step in self.at and trainer.global_step not in self.scores:
            self.scores[trainer.global_step] = evaluate(pl_module, self.prompts, self.real, self.trained)[0]
            s = self.scores[trainer.global_step]
            print(f"  at {trainer.global_step} it: " + " ".join(f"{k} {s[k]:.3f}" for k in KEYS), flush=True)


def run(config: str, seed: int, overrides: list[str], prompts, real, lr_zero: bool = False,
        at: tuple[int, ...] = ()) -> dict:
    with tempfile.TemporaryDirectory() as root:
        seeds = [f"seed_everything={seed}", f"data.init_args.seed={seed}", f"model.init_args.run.seed={seed}"]
        zero = ["model.init_args.card.experts.transformer.optimizer.init_args.lr=0.0"] if lr_zero else []
        cli = build(config, root, seeds + overrides + zero)
        trained = set(cli.datamodule.prompt_list())
        before, videos_before = evaluate(cli.model, prompts, real, trained)
        rewards = Rewards()
        cli.trainer.callbacks.append(rewards)
        if at:
            cli.trainer.callbacks.append(Midway(list(at), prompts, real, trained))
        wall, cpu = time.time(), time.process_time()
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        wall, cpu = time.time() - wall, time.process_time() - cpu
        after, videos_after = evaluate(cli.model, prompts, real, trained)
    return dict(seed=seed, before=before, after=after, wall=wall, cpu=cpu, iterations=cli.trainer.global_step,
                videos=(videos_before, videos_after), rewards=rewards.values)


def line(name: str, r: dict) -> str:
    b, a = r["before"], r["after"]
    facts = " ".join(f"{k} {b[k]:.3f}->{a[k]:.3f}" for k in KEYS)
    curve = ", ".join(f"{key} {'{:.3f} -> {:.3f}'.format(*tenths(v))}" for key, v in r["rewards"].items())
    return (f"{name}: {facts} (unseen n={a['n_unseen']}) | {curve} (first/last tenth) | {r['iterations']} it, "
            f"fit {r['wall']:.0f} s wall, {r['cpu']:.0f} s CPU")


def tenths(values: list[float]) -> tuple[float, float]:
    """Mean of the first and of the last tenth of a per-iteration curve."""
    n = max(1, len(values) // 10)
    return statistics.mean(values[:n]), statistics.mean(values[-n:])


def spread(values: list[float], digits: int = 3) -> str:
    return f"{statistics.mean(values):.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def table(config: str, runs: list[dict], control: Optional[dict]) -> str:
    """The Markdown table: per quantity, before training, after (mean [min, max] over the seeds), the control."""
    seeds = " ".join(str(r["seed"]) for r in runs)
    head = f"| {config} | before | after, seeds {seeds}: mean [min, max] |" + (" control (lr 0) |" if control else "")
    rows = [head, "|---|---|---|" + ("---|" if control else "")]
    names = {"all": "GenEval all four (seen concepts)", "unseen": "GenEval all four, captions training never saw",
             "frechet": "Fréchet VAE distance to data (lower is better)"}
    for key in ("all",) + FACTS + ("unseen", "frechet"):
        cells = [names.get(key, f"GenEval {key}"), f"{runs[0]['before'][key]:.3f}",
                 spread([r["after"][key] for r in runs])]
        if control:
            cells.append(f"{control['after'][key]:.3f}")
        rows.append("| " + " | ".join(cells) + " |")
    curves = [tenths(r["rewards"]["train/reward"]) for r in runs]
    cells = ["training reward (first → last tenth of the iterations)", spread([c[0] for c in curves]),
             spread([c[1] for c in curves])]
    if control:
        first, last = tenths(control["rewards"]["train/reward"])
        cells.append(f"{first:.3f} → {last:.3f}")
    rows.append("| " + " | ".join(cells) + " |")
    cells = ["fit: iterations, CPU s, wall s", "", f"{runs[0]['iterations']} it, "
             f"{spread([r['cpu'] for r in runs], 0)} CPU s, {spread([r['wall'] for r in runs], 0)} s wall"]
    if control:
        cells.append(f"{control['iterations']} it, {control['cpu']:.0f} CPU s")
    rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a config in configs/ (flow_grpo, diffusion_nft)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--control", action="store_true", help="also train the first seed at learning rate 0")
    parser.add_argument("--control-steps", type=int, help="the control's iterations (default: the config's; "
                        "at learning rate 0 nothing moves, so its 'after' equals 'before' at any length)")
    parser.add_argument("--prompts", type=int, default=128, help="evaluation captions of seen concepts")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides, e.g. trainer.max_steps=300")
    parser.add_argument("--at", type=int, nargs="*", default=[], help="also evaluate at these iterations")
    parser.add_argument("--sheet", help="write a before/after PNG of the first evaluation prompts here")
    args = parser.parse_args()
    cli = build(args.config, tempfile.gettempdir(), args.set)
    size = cli.model.video
    data = ShapesDataset(args.prompts, size.frames, size.height, size.width, seed=EVAL_SEED, exclude=["magenta"])
    prompts = [caption(*data.facts(i)) for i in range(len(data))]
    real = torch.stack([data[i]["video"] for i in range(len(data))])
    runs, control = [], None
    for seed in args.seeds:
        runs.append(run(args.config, seed, args.set, prompts, real, at=tuple(args.at)))
        print(line(f"{args.config} seed {seed}", runs[-1]), flush=True)
        if args.sheet and len(runs) == 1:
            sheet(args.sheet, prompts, *runs[0]["videos"])
    if args.control:
        steps = [f"trainer.max_steps={args.control_steps}"] if args.control_steps else []
        control = run(args.config, args.seeds[0], args.set + steps, prompts, real, lr_zero=True)
        print(line(f"{args.config} control (lr 0, seed {args.seeds[0]})", control), flush=True)
    print(table(args.config, runs, control), flush=True)


if __name__ == "__main__":
    main()
