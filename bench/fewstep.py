"""A few-step student measured against its many-step teacher: what ``experiments/distill.py`` reports and the DMD2
and Self-Forcing tests check.

- ``bench_cli``: a config's CLI, unrun, with no logger, checkpoints, callbacks or validation, its models built.
- ``samples``: (latents, videos) of one expert and sampler, batch ``i`` from seed ``first_seed + i``: the same
  prompts and noise (and, image-to-video, first frames: ``first_frames``) for the teacher and the student.
- ``closeness``: a set of samples against the teacher's: the Fréchet VAE distance of the frames
  (``modules/eval/frechet.py``), the latent MSE from the same noise, synthetic GenEval.
- ``all_four`` and ``held_out_prompts``: per-prompt verdicts, on captions the training prompts never name.
- ``join``: per-seed verdict files (``python -m experiments.distill --students ... --json``) joined, each student's
  ratio to the teacher with a paired bootstrap interval over prompts and seeds.
"""
from __future__ import annotations

import copy
import json
import sys
from typing import Optional
from unittest import mock

import torch

from posttrain.datamodules.synthetic import PRETRAIN_EXCLUDE, ShapesDataset, shape_start
from posttrain.lit.tools.config import PosttrainCLI
from posttrain.modules.eval.frechet import VideoFrechetDistance
from posttrain.modules.world.geneval import SyntheticGenEval, judge
from posttrain.modules.world.world import FACTS, parse_caption, render


def bench_cli(config: str, root: str, steps, *extra: str) -> PosttrainCLI:
    """The config's CLI, unrun, as every distillation measure builds it: no logger, checkpoints, callbacks or
    validation; the module's models built, in eval mode. ``steps``: the fit's iterations (None: the config's
    max_steps)."""
    more = ["--trainer.max_steps", str(steps)] if steps is not None else []
    with mock.patch.object(sys, "argv", sys.argv[:1]):
        cli = PosttrainCLI(args=["--config", config, "--trainer.default_root_dir", root, "--trainer.logger", "false",
                                 "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]",
                                 "--trainer.limit_val_batches", "0", *more, *extra], run=False)
    cli.model.configure_model()
    cli.model.eval()
    return cli


@torch.no_grad()
def samples(module, prompts: list[str], sampler, name: str, batch: int, first_seed: int = 0,
            images: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(latents, videos) of expert ``name`` with ``sampler`` (its CFG included), batch ``i`` from seed
    ``first_seed + i``: the noise ``module.generate`` draws; an image-to-video module's from ``images``, one first
    frame per prompt (``first_frames``)."""
    latents = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        g = torch.Generator().manual_seed(first_seed + i // batch)
        noise = torch.randn((len(chunk), *module.stage.latent_shape(module.video)), generator=g)
        cond, uncond = module.conditioning(chunk, sampler, None if images is None else images[i:i + batch])
        latents.append(module.stage.sample(sampler, noise, cond, uncond, name=name, rng=g).latents)
    latents = torch.cat(latents)
    return latents, module.stage.decode(latents)


def first_frames(module, prompts: list[str], seed: int) -> Optional[torch.Tensor]:
    """(n, 3, H, W) in [-1, 1], for an image-to-video module: the first frame of a clip of each caption, drawn by the
    world at the run's size, the shape's start that of row i of ``seed``'s clips (``shape_start``); None for a module
    that reads no image."""
    if not module.stage.takes_image:
        return None
    frames = []
    for i, prompt in enumerate(prompts):
        facts = parse_caption(prompt)
        frames.append(render(facts.shape, facts.colour, facts.motion, facts.background, 1, module.video.height,
                             module.video.width, start=shape_start(seed, i))[:, 0])
    return torch.stack(frames)


def closeness(prompts, teacher: tuple[torch.Tensor, torch.Tensor], other: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """``other`` (latents, videos) against the ``teacher``'s of the same prompts and noise: the Fréchet VAE distance of
    the frames, the latent MSE, and synthetic GenEval of ``other`` (each fact and ``all``)."""
    frechet = VideoFrechetDistance()
    frechet.update(teacher[1], real=True)
    frechet.update(other[1], real=False)
    geneval = SyntheticGenEval()
    geneval.update(other[1], prompts)
    return {"frechet": float(frechet.compute()), "latent_mse": float((other[0] - teacher[0]).pow(2).mean()),
            **{k: float(v) for k, v in geneval.compute().items()}}


def all_four(videos: torch.Tensor, prompts: list[str]) -> list[float]:
    """Per prompt, 1.0 where the video shows all four of its facts, else 0.0 (GenEval's ``all``, sample by sample)."""
    verdicts = judge(videos, prompts)
    return torch.stack([verdicts[f] for f in FACTS], 1).eq(1).all(1).float().tolist()


def held_out_prompts(cli, n: int, beyond: int = 0) -> list[str]:
    """``n`` seen-concept captions the training prompts never name (``exclude_captions``): a held-out evaluation.
    ``beyond``: nor the first ``beyond`` synthetic training captions (a config training on fewer captions, scored on
    the held-out set of one training on more: the synthetic captions of a seed are a prefix of a longer draw)."""
    train = cli.datamodule.prompt_list()
    if beyond:
        if cli.datamodule.path is not None or cli.datamodule.inline is not None:
            raise SystemExit("--held-out-beyond extends the config's synthetic captions, but its data names a prompt "
                             "file or list; drop the option or use `num_synthetic`")
        more = copy.copy(cli.datamodule)
        more.num_synthetic = beyond
        train += more.prompt_list()
    return ShapesDataset(n, 1, 8, 8, seed=5, exclude=PRETRAIN_EXCLUDE, exclude_captions=sorted(set(train))).captions()


def verdict_tables(paths: list[str], first: Optional[str] = None) -> tuple[list[str], torch.Tensor, dict]:
    """The ``--students ... --json`` files ``paths`` (one process per seed) as (prompts, the teacher's verdicts,
    {step count: (seeds, (seeds, prompts) verdicts, the start's verdicts)}); every file must be scored on the held-out
    prompts and teacher of ``first`` (default: the first file)."""
    def read(path: str) -> dict:
        try:
            with open(path) as f:
                run = json.load(f)
        except (OSError, ValueError) as e:
            raise SystemExit(f"--join: cannot read {path}: {e}")
        if not isinstance(run, dict) or not {"prompts", "teacher", "students"} <= run.keys():
            raise SystemExit(f"--join: {path} is not a `--students ... --json` file (it lacks prompts, teacher or "
                             f"students); write one with --students N --json {path}")
        return run

    runs = [read(path) for path in paths]
    first, reference = (paths[0], runs[0]) if first is None else (first, read(first))
    for path, run in zip(paths, runs):
        if run["prompts"] != reference["prompts"] or run["teacher"] != reference["teacher"]:
            raise SystemExit(f"--join: {path} was scored on other held-out prompts or another teacher than {first}; "
                             f"join runs of one --prompts / --held-out-beyond and one teacher")
    tables = {}
    for n in sorted({n for run in runs for n in run["students"]}, key=int):
        after = {seed: v for run in runs if n in run["students"] for seed, v in run["students"][n]["after"].items()}
        before = next(run["students"][n]["before"] for run in runs if n in run["students"])
        seeds = sorted(after, key=int)
        tables[n] = (seeds, torch.tensor([after[seed] for seed in seeds]), before)
    return reference["prompts"], torch.tensor(reference["teacher"]), tables


def bootstrap(table: torch.Tensor, p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """All four of (seeds, prompts) ``table`` on each draw's prompts ``p`` (draws, prompts), its seeds resampled."""
    k = torch.randint(table.shape[0], (p.shape[0], table.shape[0]), generator=g)
    return table[k.unsqueeze(-1), p.unsqueeze(1)].mean((1, 2))


def join(paths: list[str], line: float = 0.95, draws: int = 10000, baseline: Optional[list[str]] = None) -> None:
    """Join ``--students ... --json`` files (one process per seed) scored on one held-out set, and say per step count
    how near the teacher the students are: all four over seeds and prompts, its ratio to the teacher's on the same
    prompts, and that ratio's 95% interval from a paired bootstrap over both sources of chance — the prompts (teacher
    and students resampled together) and the fits (the seeds resampled) — with the share of draws at or above
    ``line`` (the goal's 0.95 of the teacher); then all four by each value of each fact the prompts ask (where the
    students fall short). With ``baseline`` (another option's files on the same prompts): each student's difference
    from the baseline's, its interval from the same draws (the prompts paired, each side's seeds resampled)."""
    prompts, teacher, tables = verdict_tables(paths)
    g = torch.Generator().manual_seed(0)
    print(f"{len(prompts)} held-out prompts; the teacher's all four {teacher.mean():.3f}; 95% intervals from {draws} "
          f"paired bootstrap draws of prompts and seeds\n")
    print(f"| student steps | seeds | all four: before → after, mean [min, max] of seeds | ratio to the teacher [95% "
          f"interval] | draws ≥ {line} |\n|---|---|---|---|---|")
    against = verdict_tables(baseline, first=paths[0])[2] if baseline else {}
    differences = []
    for n, (seeds, table, before) in tables.items():
        p = torch.randint(len(prompts), (draws, len(prompts)), generator=g)
        students = bootstrap(table, p, g)
        ratio = students / teacher[p].mean(1).clamp(min=1e-9)
        low, high = torch.quantile(ratio, torch.tensor([0.025, 0.975])).tolist()
        means = table.mean(1)
        print(f"| {n} | {' '.join(seeds)} | {sum(before) / len(before):.3f} → {means.mean():.3f} "
              f"[{means.min():.3f}, {means.max():.3f}] | {means.mean() / teacher.mean():.3f} [{low:.3f}, {high:.3f}] "
              f"| {(ratio >= line).float().mean():.0%} |")
        if n in against:
            base_seeds, base, _ = against[n]
            gap = students - bootstrap(base, p, g)
            low, high = torch.quantile(gap, torch.tensor([0.025, 0.975])).tolist()
            differences.append(f"| {n} | {' '.join(base_seeds)} | {base.mean():.3f} | {table.mean() - base.mean():+.3f} "
                               f"[{low:+.3f}, {high:+.3f}] | {(gap > 0).float().mean():.0%} |")
    if differences:
        print("\nagainst the baseline (--baseline), the same prompts:\n\n| student steps | baseline seeds | baseline all "
              "four | difference [95% interval] | draws > 0 |\n|---|---|---|---|---|")
        print("\n".join(differences))
    print("\nall four by what the prompt asks (prompts: teacher / each student, mean over its seeds):")
    for fact in FACTS:
        values = [getattr(parse_caption(prompt), fact) for prompt in prompts]
        cells = []
        for value in sorted(set(values)):
            mask = torch.tensor([v == value for v in values])
            cells.append(f"{value} ({int(mask.sum())}): {teacher[mask].mean():.3f} / " + " / ".join(
                f"{n}-step {table.mean(0)[mask].mean():.3f}" for n, (_, table, _) in tables.items()))
        print(f"- {fact}: " + "; ".join(cells))
