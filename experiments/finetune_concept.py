"""Does the main job teach its concept? ``configs/finetune.yaml`` run as it is, with the samples it teaches looked
at before and after, and scored on evaluation captions the run never trained on.

1. Build the config's run (``posttrain fit`` through ``PosttrainCLI``, into a temporary folder: W&B offline,
   its own callbacks), sample the prompts of the sheet with the serving generator and the config's sampler
   (CFG included), ``fit``, sample them again from the same noise.
2. Score, with synthetic GenEval, the held-out-concept captions of ``configs/eval/geneval.yaml`` (its seed
   and concept: the same 32 as ``experiments/results.py``) before and after, split into the captions that also
   appear in the run's training data (at other layouts and noise) and those that never do. The world has
   only 120 captions with magenta, so nearly every evaluation caption is in a 512-sample epoch;
   ``--disjoint`` holds the evaluation's captions out of the training data (``exclude_captions``), so every
   score is on combinations of shape, colours and motion the run never trained on.
3. ``--sheet``: a PNG (matplotlib) of the sheet's prompts, one row each: the rendered data, the sample
   before, the sample after (every frame), with the facts GenEval reads back from each sample.

    python -m experiments.finetune_concept --sheet docs/finetune/samples.png   # one default run
    python -m experiments.finetune_concept --disjoint --seed 1                 # unseen captions, another seed
    python -m experiments.finetune_concept --set trainer.max_steps=100         # any override
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from unittest import mock

import numpy as np
import torch
import yaml

from posttrain.callbacks.samples import DEFAULT_PROMPTS
from posttrain.datamodules.synthetic import ShapesDataset
from posttrain.lit.tools.config import PosttrainCLI
from posttrain.modules.world.geneval import SyntheticGenEval, read_facts
from posttrain.modules.io.media import to_frames
from posttrain.modules.world.world import caption, parse_caption, render

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHEET_SEED = 0  # SampleVideos' seed: the first two rows are the run's sample GIFs (same prompts, same noise)


def evaluation_set(name: str) -> dict:
    """The ``Evaluate`` settings named ``name`` in ``configs/eval/geneval.yaml``."""
    with open(os.path.join(ROOT, "configs", "eval", "geneval.yaml")) as f:
        callbacks = yaml.safe_load(f)["trainer"]["callbacks+"]
    return next(c["init_args"] for c in callbacks if c["init_args"]["name"] == name)


def captions_of(settings: dict) -> list[str]:
    data = ShapesDataset(settings["num_prompts"], 1, 8, 8, seed=settings.get("seed", 1000),
                         exclude=settings.get("exclude", ()), include=settings.get("include", ()))
    return [caption(*data.facts(i)) for i in range(len(data))]


@torch.no_grad()
def sample(module, prompts: list[str], seed: int, batch: int = 16) -> torch.Tensor:
    """Videos of ``prompts``, batch ``k`` from ``seed + k·batch`` (as ``Evaluate`` draws its noise)."""
    was_training = module.training
    module.eval()
    videos = torch.cat([module.generate(prompts[i:i + batch], seed=seed + i).float().cpu()
                        for i in range(0, len(prompts), batch)])
    module.train(was_training)
    return videos


def geneval(videos: torch.Tensor, prompts: list[str]) -> dict[str, float]:
    metric = SyntheticGenEval()
    metric.update(videos, prompts)
    return {k: float(v) for k, v in metric.compute().items()}


def filmstrip(video: torch.Tensor) -> np.ndarray:
    """(H, F·W + gaps, 3) uint8: the frames side by side, 2 white columns between them."""
    frames = to_frames(video)  # (F, H, W, 3) uint8
    gap = np.full((frames.shape[1], 2, 3), 255, dtype=np.uint8)
    return np.concatenate([x for f in frames for x in (f, gap)][:-1], axis=1)


def sheet(path: str, prompts: list[str], before: torch.Tensor, after: torch.Tensor, held_out: set[str],
          iterations: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(prompts), 3, figsize=(13, 1.45 * len(prompts) + 0.4), squeeze=False)
    size = (before.shape[2], before.shape[3], before.shape[4])
    for r, prompt in enumerate(prompts):
        wanted = parse_caption(prompt)
        data = render(wanted.shape, wanted.colour, wanted.motion, wanted.background, *size)
        for c, (title, video) in enumerate((("data", data), ("before", before[r]), (f"after {iterations} it.",
                                                                                   after[r]))):
            ax = axes[r][c]
            ax.imshow(filmstrip(video), interpolation="nearest")
            ax.set_xticks([]), ax.set_yticks([])
            if c == 0:
                ax.set_ylabel(("held-out\n" if prompt in held_out else "seen\n") + "\n".join(
                    prompt.replace(" on a ", "\non a ").split("\n")), rotation=0, ha="right", va="center", fontsize=7)
                ax.set_title(title if r == 0 else "", fontsize=9)
                continue
            facts = read_facts(video)
            ok = facts == wanted
            ax.set_title(f"{title}: read {facts.colour} {facts.shape} {facts.motion} on {facts.background} "
                         f"{'✓' if ok else '✗'}", fontsize=7, color="darkgreen" if ok else "darkred")
    fig.suptitle("configs/finetune.yaml: samples of the serving generator before and after fit (same noise)",
                 fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "finetune.yaml"))
    parser.add_argument("--seed", type=int, default=None, help="one seed on the run's three RNGs (default: the "
                        "config's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override, e.g. trainer.max_steps=100 (repeatable)")
    parser.add_argument("--disjoint", action="store_true", help="hold the evaluation's held-out-concept captions "
                        "out of the training data")
    parser.add_argument("--sheet", default=None, help="write the before/after PNG here")
    args = parser.parse_args()

    held_settings = evaluation_set("eval/held_out")
    held = captions_of(held_settings)
    seen = captions_of(evaluation_set("eval/seen"))
    shown = list(DEFAULT_PROMPTS) + [p for p in dict.fromkeys(held) if p not in DEFAULT_PROMPTS][:4] + seen[:2]

    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(sys, "argv", sys.argv[:1]):
        extra = ["--trainer.default_root_dir", tmp] + [f"--{kv}" for kv in args.set]
        if args.disjoint:
            extra += [f"--data.init_args.exclude_captions={json.dumps(sorted(set(held)))}"]
        if args.seed is not None:
            extra += [f"--seed_everything={args.seed}", f"--data.init_args.seed={args.seed}",
                      f"--model.init_args.run.seed={args.seed}"]
        cli = PosttrainCLI(args=["--config", args.config, *extra], run=False)
        module = cli.model
        module.configure_model()
        data = cli.datamodule.train_dataset()
        trained = {caption(*data.facts(i)) for i in range(len(data))}
        eval_seed = held_settings.get("seed", 1000)
        before = {"held": sample(module, held, eval_seed), "shown": sample(module, shown, SHEET_SEED)}
        cli.trainer.fit(module, datamodule=cli.datamodule)
        after = {"held": sample(module, held, eval_seed), "shown": sample(module, shown, SHEET_SEED)}
        iterations = cli.trainer.global_step

    in_train = [i for i, p in enumerate(held) if p in trained]
    unseen = [i for i, p in enumerate(held) if p not in trained]
    print(f"{len(held)} held-out-concept evaluation captions ({len(set(held))} distinct): {len(in_train)} also in the "
          f"run's {len(data)} training samples (other layouts and noise), {len(unseen)} never in them")
    print("| held-out-concept captions | n | all four before → after | colour | background |\n|---|---|---|---|---|")
    for label, rows in (("all", list(range(len(held)))), ("in the training data", in_train),
                        ("never in the training data", unseen)):
        if not rows:
            continue
        prompts = [held[i] for i in rows]
        b, a = geneval(before["held"][rows], prompts), geneval(after["held"][rows], prompts)
        print(f"| {label} | {len(rows)} | {b['all']:.3f} → {a['all']:.3f} | {b['colour']:.3f} → {a['colour']:.3f} | "
              f"{b['background']:.3f} → {a['background']:.3f} |")
    if args.sheet:
        sheet(args.sheet, shown, before["shown"], after["shown"], set(held) | {DEFAULT_PROMPTS[1]}, iterations)
        print(f"sample sheet: {args.sheet}")


if __name__ == "__main__":
    main()
