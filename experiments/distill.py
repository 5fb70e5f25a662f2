"""DMD2 and Self-Forcing distillation: the few-step student's sampling time against the teacher's, and how close
its samples come to the teacher's many-step CFG samples, before and after ``fit``.

1. Time: one batch of the served student (the config's few-step sampler, no CFG) against the teacher's
   sampler (the config's ``teacher_sampler``: many steps with CFG, two forwards a step), VAE decoding
   included, alternated in blocks (``bench/timing.py``); the ratio with its interval.
2. Closeness, on ``--prompts`` seen-concept synthetic captions with fixed seeds, each set against the teacher's
   many-step CFG samples of the same prompts and noise: the Fréchet VAE distance of the frames
   (``modules/eval/frechet.py``), the latent MSE from the same noise, and synthetic GenEval of each set (the teacher's
   own is the target). Rows: the teacher run with the student's few steps (whole video at once), the student
   before training (it starts from the teacher's weights: for DMD2 the same samples as the row above, for
   Self-Forcing the teacher's weights run chunk by chunk with the KV cache) and after ``fit`` of the config in
   this process.

    python -m experiments.distill                            # configs/dmd2.yaml, a few minutes on 2 CPU cores
    python -m experiments.distill --config configs/self_forcing.yaml --grid docs/distill/self_forcing.png
    python -m experiments.distill --steps 100 --prompts 32
    python -m experiments.distill --students 2 --compile-decode   # also time with the VAE's decoder compiled
    python -m experiments.distill --students 1 2 4 --channels-last --time-only   # the VAE channels-last, timing alone
    python -m experiments.distill --students 2 --held-out-beyond 256   # held-out captions past the first 256 ones
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time

import torch

from bench.fewstep import all_four, bench_cli, closeness, first_frames, held_out_prompts, join, samples
from bench.timing import compare, interleave
from posttrain.datamodules.synthetic import PRETRAIN_EXCLUDE, ShapesDataset
from posttrain.modules.models.cards import compile_in_place, to_channels_last
from posttrain.modules.eval.frechet import VideoFrechetDistance
from posttrain.modules.world.geneval import SyntheticGenEval, windows
from posttrain.modules.io.media import grid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def row(name: str, scores: dict) -> str:
    return (f"| {name} | {scores['frechet']:.3f} | {scores['latent_mse']:.4f} | {scores['all']:.3f} | "
            f"{scores['shape']:.2f} / {scores['colour']:.2f} / {scores['background']:.2f} / {scores['motion']:.2f} |")


# ---------------------------------------------------------------------- Self-Forcing on long clips (--per-chunk)


def window_scores(prompts: list[str], reference: list[torch.Tensor], parts: list[torch.Tensor]) -> dict:
    """GenEval of the windows ``parts`` (all of one position, or a block of positions), and their Fréchet VAE distance
    to the teacher's windows ``reference`` (every position of its clips pooled)."""
    frechet = VideoFrechetDistance()
    for part in reference:
        frechet.update(part, real=True)
    geneval = SyntheticGenEval()
    for part in parts:
        frechet.update(part, real=False)
        geneval.update(part, prompts)
    return {"frechet": float(frechet.compute()), **{k: float(v) for k, v in geneval.compute().items()}}


@torch.no_grad()
def rollout(module, prompts: list[str], sampler, batch: int, latent_frames: int) -> torch.Tensor:
    """Decoded student videos of ``latent_frames`` latent frames (past the clip: the served chunk loop, its KV cache
    plain or rolling as ``sampler`` says), batch ``i`` from seed ``i`` as ``samples``."""
    videos = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        g = torch.Generator().manual_seed(i // batch)
        shape = list(module.stage.latent_shape(module.video))
        shape[1] = latent_frames
        noise = torch.randn((len(chunk), *shape), generator=g)
        cond, uncond = module.conditioning(chunk, sampler)
        latents = module.stage.sample(sampler, noise, cond, uncond, name=module.serving_transformer, rng=g).latents
        videos.append(module.stage.decode(latents))
    return torch.cat(videos)


def measure_chunks(module, prompts: list[str], teacher: tuple[torch.Tensor, torch.Tensor], batch: int,
                   lengths: int) -> tuple[dict, dict]:
    """The student's scores on the clip (``closeness``), per window position, and ``lengths``× past the clip with
    the plain cache and the rolling one (W = the chunks before the clip's last: the most context training showed),
    per clip length (window p counts in the clip length its latent frame p falls in). Returns (scores, videos for
    the sheet)."""
    sampler = module.sampler
    clip = samples(module, prompts, sampler, module.serving_transformer, batch)
    reference = windows(teacher[1])
    scores = {"clip": closeness(prompts, teacher, clip),
              "windows": [window_scores(prompts, reference, [w]) for w in windows(clip[1])]}
    latent_frames, n = clip[0].shape[2], sampler.chunk_frames
    rolling = copy.copy(sampler)
    rolling.cache_chunks = latent_frames // n - 1
    videos = {"clip": clip[1]}
    for name, served in {"plain": sampler, "rolling": rolling}.items():
        long = rollout(module, prompts, served, batch, lengths * latent_frames)
        parts = windows(long)  # window p ends on latent frame p (p = 1 ..)
        scores[name] = [window_scores(prompts, reference, [w for p, w in enumerate(parts, 1) if p // latent_frames == b])
                        for b in range(lengths)]
        videos[name] = long
    return scores, videos


def time_sampling(module, prompts: list[str], blocks: int, note: str = "", name: str = "time student/teacher",
                  images=None):
    """One batch sampled by the teacher (its steps, CFG) and by the student (from the first frames ``images``,
    image-to-video), in alternating blocks (``bench/timing.py``), VAE decoding included; prints and returns the
    comparison."""
    teacher, student = module.teacher_sampler, module.sampler
    timed = interleave(lambda: samples(module, prompts, teacher, "teacher", len(prompts), images=images),
                       lambda: samples(module, prompts, student, "transformer", len(prompts), images=images),
                       blocks=blocks, per_block=1, names=("teacher", "student"))
    print(f"sampling {len(prompts)} videos of {module.video}: teacher {teacher.num_steps} steps with CFG "
          f"{teacher.guidance_scale} vs student {student.num_steps} steps{note}")
    comparison = compare(timed, per="batch", ratio_name=name)
    print(comparison.report(), flush=True)
    return comparison


def spread(values: list[float], digits: int = 3) -> str:
    """mean [min, max] of the seeds (the value alone for one seed)."""
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def chunk_tables(runs: dict[str, list[dict]], target: dict, teacher_windows: list[dict]) -> str:
    """Markdown tables of ``runs`` (row name -> one scores dict per seed): the clip, per window position, past the
    clip per block of positions."""
    def cell(seeds, get):
        return " / ".join(spread([get(s)[k] for s in seeds], 2) for k in ("all", "motion", "frechet"))

    some = next(iter(runs.values()))[0]
    lines = ["| samples | clip: Fréchet / latent MSE / GenEval all / motion |" +
             "".join(f" window {p + 1} (frames {4 * p}–{4 * p + 4}): all / motion / Fréchet |"
                     for p in range(len(some["windows"]))), "|---|---|" + "---|" * len(some["windows"])]
    lines.append(f"| teacher, 20 steps CFG | 0 / 0 / {target['all']:.2f} / {target['motion']:.2f} |" +
                 "".join(f" {w['all']:.2f} / {w['motion']:.2f} / {w['frechet']:.2f} |" for w in teacher_windows))
    for name, seeds in runs.items():
        clip = " / ".join(spread([s["clip"][k] for s in seeds], 2) for k in ("frechet", "latent_mse", "all", "motion"))
        lines.append(f"| {name} | {clip} |" + "".join(
            f" {cell(seeds, lambda s, p=p: s['windows'][p])} |" for p in range(len(some["windows"]))))
    blocks = len(some["plain"])
    lines += ["", "| samples past the clip | cache |" + "".join(
        f" clip length ×{b + 1}: all / motion / Fréchet |" for b in range(blocks)), "|---|---|" + "---|" * blocks]
    for name, seeds in runs.items():
        for cache in ("plain", "rolling"):
            lines.append(f"| {name} | {cache} |" + "".join(
                f" {cell(seeds, lambda s, b=b: s[cache][b])} |" for b in range(blocks)))
    return "\n".join(lines)


def self_forcing_bench(args) -> None:
    """``--per-chunk``: the config fitted from ``--seeds`` seeds (and a zero student learning rate, ``--control``),
    each student scored on the clip, per window position and past the clip (``measure_chunks``), against the
    teacher's many-step CFG samples; the time ratio of one batch as ``main``'s."""
    def build(seed: int, *more: str):
        chunk = ["--model.init_args.sampler.init_args.chunk_frames", str(args.chunk_frames)] \
            if args.chunk_frames is not None else []
        return bench_cli(args.config, tmp, args.steps, "--seed_everything", str(seed), "--model.init_args.run.seed",
                         str(seed), *more, *chunk)

    def fitted(cli):
        cli.model.train()
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        cli.model.eval()
        return cli.model

    with tempfile.TemporaryDirectory() as tmp:
        cli = build(0)
        module = cli.model
        student_sampler, teacher_sampler = module.sampler, module.teacher_sampler
        if not student_sampler.chunk_frames:
            raise SystemExit(f"--per-chunk measures a chunked (Self-Forcing) student; {args.config} has "
                             f"sampler.chunk_frames: null")
        data = ShapesDataset(args.prompts, 1, 8, 8, seed=5, exclude=PRETRAIN_EXCLUDE)
        prompts = [data[i]["prompt"] for i in range(len(data))]

        # 1. sampling time of one batch, student against teacher, interleaved
        time_sampling(module, prompts[:args.batch], args.blocks,
                      f", chunks of {student_sampler.chunk_frames} latent frame(s)")

        # 2. the teacher's samples (the reference) and its own scores; the student before training
        teacher = samples(module, prompts, teacher_sampler, "teacher", args.batch)
        geneval = SyntheticGenEval()
        geneval.update(teacher[1], prompts)
        target = {k: float(v) for k, v in geneval.compute().items()}
        reference = windows(teacher[1])
        teacher_windows = [window_scores(prompts, reference, [w]) for w in reference]
        before, sheet = measure_chunks(module, prompts, teacher, args.batch, args.lengths)
        runs = {"student before training (the teacher's weights, chunked, KV cache)": [before]}
        print(chunk_tables(runs, target, teacher_windows), flush=True)

        # 3. fit from each seed; the zero-lr control
        after, steps = [], None
        for seed in args.seeds:
            trained = fitted(build(seed))
            steps = trained.trainer.global_step
            scores, videos = measure_chunks(trained, prompts, teacher, args.batch, args.lengths)
            after.append(scores)
            sheet = videos if seed == 0 else sheet
            print(f"seed {seed}: clip {scores['clip']}", flush=True)
        runs[f"student after {steps} iterations ({len(args.seeds)} seeds: mean [min, max])"] = after
        if args.control:
            control = fitted(build(0, "--model.init_args.card.experts.transformer.optimizer.init_args.lr", "0.0"))
            runs["control: student lr 0 (seed 0)"] = [measure_chunks(control, prompts, teacher, args.batch,
                                                                     args.lengths)[0]]
    print(f"\n{len(prompts)} seen-concept prompts, {module.video.frames}-frame clips; chunks of "
          f"{student_sampler.chunk_frames} latent frame(s); reference: the teacher, {teacher_sampler.num_steps} steps, "
          f"CFG {teacher_sampler.guidance_scale}; Fréchet VAE distance to the teacher's windows, all positions pooled; "
          f"past the clip: {args.lengths}× its latent frames, the plain cache keeping every chunk, the rolling one the "
          f"last {teacher[0].shape[2] // student_sampler.chunk_frames - 1} chunks\n")
    print(chunk_tables(runs, target, teacher_windows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": target, "teacher_windows": teacher_windows, "runs": runs}, f, indent=1)
    if args.grid:
        every = slice(0, None, 4)  # the last pixel frame of each latent frame
        rows = []
        for i in range(min(4, len(prompts))):
            rows.append((f"{prompts[i][:60]}: teacher, {teacher_sampler.num_steps} steps, CFG (every 4th frame)",
                         teacher[1][i][:, every]))
            rows.append((f"student after {steps} iterations (seed 0)", sheet["clip"][i][:, every]))
            rows.append((f"the same, {args.lengths}x the clip, plain cache", sheet["plain"][i][:, every]))
            rows.append((f"the same, {args.lengths}x the clip, rolling cache", sheet["rolling"][i][:, every]))
        grid(rows, scale=4).save(args.grid)
        print(f"\nsamples of the first {min(4, len(prompts))} prompts: {args.grid}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "dmd2.yaml"))
    parser.add_argument("--steps", type=int, default=None, help="fit iterations (default: the config's max_steps)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=5, help="timing blocks")
    parser.add_argument("--grid", default=None, help="write a PNG of the first 4 prompts' samples (every row) here")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="with --students: a fit per seed (default 0); with --per-chunk: (default 0 1 2)")
    parser.add_argument("--students", type=int, nargs="+", default=None,
                        help="DMD2: train one student per step count (e.g. 1 2 4) and report a row each, on held-out "
                             "prompts and noise (students())")
    parser.add_argument("--compile-decode", action="store_true",
                        help="with --students: also time both sides with the VAE's decoder compiled (torch.compile, as "
                             "an expert's `compile: true` does), after the eager timing; the evaluation then decodes "
                             "with it too")
    parser.add_argument("--channels-last", action="store_true",
                        help="with --students: also time both sides with the VAE's convolutions channels-last (the "
                             "expert option `channels_last: true`), after the eager timing (before compiling, with "
                             "--compile-decode); the evaluation then decodes with it too")
    parser.add_argument("--held-out-beyond", type=int, default=0, metavar="N",
                        help="with --students: the held-out captions also avoid the first N synthetic training "
                        "captions (e.g. 256: a config on 64 scored on the held-out set of one on 256)")
    parser.add_argument("--time-only", action="store_true", help="with --students: the timings alone, no fit or "
                        "evaluation (the student's weights do not change its time)")
    parser.add_argument("--per-chunk", action="store_true", help="Self-Forcing: scores per window position and past "
                        "the clip (plain and rolling KV cache), over --seeds fits (self_forcing_bench)")
    parser.add_argument("--control", action="store_true", help="with --per-chunk: also a zero student lr fit")
    parser.add_argument("--lengths", type=int, default=3, help="with --per-chunk: generate this many clip lengths")
    parser.add_argument("--json", default=None, help="with --per-chunk: write every score here; with --students: "
                        "each held-out prompt's all-four verdict (teacher, before, each seed's student), for --join")
    parser.add_argument("--join", nargs="+", default=None, metavar="JSON", help="join --students --json files "
                        "(e.g. one process per seed) and report each student's ratio to the teacher with a paired "
                        "bootstrap interval over prompts and seeds (bench/fewstep.py's join)")
    parser.add_argument("--baseline", nargs="+", default=None, metavar="JSON", help="with --join: another option's "
                        "files on the same prompts; each student's difference from them, with its interval")
    parser.add_argument("--chunk-frames", type=int, default=None, help="with --per-chunk: the student's chunk "
                        "(latent frames; default: the config's sampler.chunk_frames)")
    args, overrides = parser.parse_known_args()  # the rest goes to the CLI, e.g. --model.init_args.gan.critic_weight 0
    if args.baseline and not args.join:
        parser.error("--baseline compares with the students of --join; add --join")
    if args.join:
        return join(args.join, baseline=args.baseline)
    if args.per_chunk:
        if overrides:
            parser.error(f"--per-chunk takes no CLI overrides (got {overrides}); edit a copy of --config instead")
        args.seeds = args.seeds or [0, 1, 2]
        return self_forcing_bench(args)
    args.seeds = args.seeds or [0]
    if args.held_out_beyond and not args.students:
        parser.error("--held-out-beyond scores the --students rows; add --students")
    if args.students:
        return students(args, overrides)

    with tempfile.TemporaryDirectory() as tmp:
        cli = bench_cli(args.config, tmp, args.steps, *overrides)
        module = cli.model
        if module.stage.takes_image:
            raise SystemExit(f"{args.config} distills an image-to-video generator: measure it with --students (each "
                             f"held-out caption with the first frame of a clip of it)")
        student_sampler, teacher_sampler = module.sampler, module.teacher_sampler
        data = ShapesDataset(args.prompts, 1, 8, 8, seed=5, exclude=PRETRAIN_EXCLUDE)
        prompts = [data[i]["prompt"] for i in range(len(data))]

        # 1. sampling time of one batch
        time_sampling(module, prompts[:args.batch], args.blocks)

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
        sets["after"] = samples(module, prompts, student_sampler, module.serving_transformer, args.batch)
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


# ------------------------------------------------------------------------------------------- DMD2 students
HELD_OUT_SEED = 1000  # the evaluation's noise seeds start here; training draws from the module's own streams


def shares(module, prompts: list[str], sampler, blocks: int, images=None) -> tuple[float, float]:
    """(decode, conditioning) time of one served batch as shares of the whole (encode with an emptied cache,
    image-to-video the first frames ``images`` too, sample, decode), each median of ``blocks`` interleaved pairs."""
    cond_name = module.stage.encoders[0]

    def encode():
        module.card.cache.invalidate(cond_name)
        return module.conditioning(prompts, sampler, images)

    def whole():
        encode()
        return samples(module, prompts, sampler, "transformer", len(prompts), images=images)

    latents = samples(module, prompts, sampler, "transformer", len(prompts), images=images)[0]
    decode = compare(interleave(whole, lambda: module.stage.decode(latents), blocks=blocks, per_block=1,
                                names=("whole", "decode")), per="batch")
    text = compare(interleave(whole, encode, blocks=blocks, per_block=1, names=("whole", "encode")), per="batch")
    return decode.ratios["wall"].median, text.ratios["wall"].median


def students(args, overrides: list[str]) -> None:
    """One DMD2 student per ``--students`` step count, ``--seeds`` fits each, on held-out prompts and noise: its
    sampling time against the teacher's (interleaved, decode included; the shares of decoding and of text encoding),
    then GenEval, motion and Fréchet distance to the teacher's samples before (the teacher's weights at the student's
    steps, which is also the zero-student-lr control: lr 0 leaves the student bitwise, tests/test_dmd2.py) and after
    ``fit``."""
    rows, sheet, teacher, target, prompts, images, faster = [], [], None, None, None, None, {}
    verdicts: dict = {"students": {}}  # per prompt, all four shown (1) or not (0): --json, --join
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.students:
            after, before, timing = [], None, None
            for seed in args.seeds:
                cli = bench_cli(args.config, os.path.join(tmp, f"{n}-{seed}"), args.steps,
                                "--model.init_args.student_steps", str(n), "--seed_everything", str(seed),
                                "--model.init_args.run.seed", str(seed), *overrides)
                module = cli.model
                if teacher is None:  # the same frozen teacher in every fit: its samples once
                    prompts = held_out_prompts(cli, args.prompts, args.held_out_beyond)
                    images = first_frames(module, prompts, HELD_OUT_SEED)  # image-to-video: a clip's first frame
                    teacher = samples(module, prompts, module.teacher_sampler, "teacher", args.batch, HELD_OUT_SEED,
                                      images)
                    geneval = SyntheticGenEval()
                    geneval.update(teacher[1], prompts)
                    target = {k: float(v) for k, v in geneval.compute().items()}
                    verdicts.update(prompts=prompts, teacher=all_four(teacher[1], prompts))
                if timing is None:
                    one, first = prompts[:args.batch], None if images is None else images[:args.batch]
                    ratio = time_sampling(module, one, args.blocks, name=f"time {n}-step student/teacher",
                                          images=first)
                    timing = (ratio.ratios["wall"], *shares(module, one, module.sampler, args.blocks, first))
                    if args.channels_last or args.compile_decode:  # the same VAE decodes both sides: time again
                        vae = module.card.models[module.stage.vae]
                        how = " and ".join(what for what, asked in (("channels-last", args.channels_last),
                                                                    ("compiled", args.compile_decode)) if asked)
                        if args.channels_last:
                            to_channels_last(vae)
                        if args.compile_decode:
                            compile_in_place(vae)
                        started = time.perf_counter()  # compiling happens in the first call
                        samples(module, one, module.sampler, "transformer", len(one), images=first)
                        compile_s = time.perf_counter() - started
                        ratio = time_sampling(module, one, args.blocks, note=f", VAE {how}",
                                              name=f"time {n}-step student/teacher, VAE {how}", images=first)
                        faster[n] = (how, ratio.ratios["wall"],
                                     *shares(module, one, module.sampler, args.blocks, first), compile_s)
                    if args.time_only:
                        break
                    start = samples(module, prompts, module.sampler, "transformer", args.batch, HELD_OUT_SEED,
                                    images)
                    before = closeness(prompts, teacher, start)
                    verdicts["students"][str(n)] = {"before": all_four(start[1], prompts), "after": {}}
                module.train()
                started = time.perf_counter()
                cli.trainer.fit(module, datamodule=cli.datamodule)
                fit_s = time.perf_counter() - started
                module.eval()
                done = samples(module, prompts, module.sampler, module.serving_transformer, args.batch, HELD_OUT_SEED,
                               images)
                after.append({**closeness(prompts, teacher, done), "fit_s": fit_s})
                verdicts["students"][str(n)]["after"][str(seed)] = all_four(done[1], prompts)
                print(f"{n} steps, seed {seed}: {after[-1]}", flush=True)
                if seed == args.seeds[0]:
                    sheet.append((n, start[1], done[1], cli.trainer.global_step))
            rows.append((n, timing, before, after))
    if args.json and not args.time_only:
        with open(args.json, "w") as f:
            json.dump(verdicts, f)
    print(f"\n{len(prompts)} held-out prompts (captions the training prompts never name, seen concepts), noise seeds "
          f"from {HELD_OUT_SEED}; target: the teacher, {module.teacher_sampler.num_steps} steps, CFG "
          f"{module.teacher_sampler.guidance_scale}: GenEval all {target['all']:.3f}, motion {target['motion']:.3f}")
    print(f"seeds {args.seeds}: mean [min, max]; 'before' = the teacher's weights at the student's steps = the "
          f"zero-student-lr control\n")
    print("| student steps | time student/teacher [CI of the median] (speed-up) | decode / text-encoding share of the student's "
          "time | GenEval all: before → after | motion: before → after | Fréchet to the teacher: before → after "
          "| fit (s) |\n|---|---|---|---|---|---|---|")
    for n, (ratio, decode, text), before, after in rows:
        if not after:  # --time-only
            print(f"| {n} | {ratio.median:.3f} [{ratio.coverage:.0%} CI {ratio.ci[0]:.3f}–{ratio.ci[1]:.3f}] "
                  f"(×{1 / ratio.median:.1f}) | {decode:.0%} / {text:.0%} | – | – | – | – |")
            continue
        print(f"| {n} | {ratio.median:.3f} [{ratio.coverage:.0%} CI {ratio.ci[0]:.3f}–{ratio.ci[1]:.3f}] "
              f"(×{1 / ratio.median:.1f}) | "
              f"{decode:.0%} / {text:.0%} | {before['all']:.3f} → {spread([a['all'] for a in after])} | "
              f"{before['motion']:.3f} → {spread([a['motion'] for a in after])} | {before['frechet']:.3f} → "
              f"{spread([a['frechet'] for a in after])} | {spread([a['fit_s'] for a in after], 0)} |")
    for n, (how, ratio, decode, text, compile_s) in faster.items():
        first = f"; compile and warm-up {compile_s:.0f} s" if "compiled" in how else ""
        print(f"\n{n} steps, the VAE {how} (both sides{first}): time "
              f"student/teacher {ratio.median:.3f} [{ratio.coverage:.0%} CI {ratio.ci[0]:.3f}–{ratio.ci[1]:.3f}] "
              f"(×{1 / ratio.median:.1f}); decode / text-encoding share of the student's time {decode:.0%} / {text:.0%}")
    if args.grid:
        shown = []
        for i in range(min(4, len(prompts))):
            shown.append((f"{prompts[i][:60]}: teacher, {module.teacher_sampler.num_steps} steps, CFG", teacher[1][i]))
            for n, start, done, steps in sheet:
                shown += [(f"{n}-step student before", start[i]), (f"{n}-step student after {steps} iterations",
                                                                   done[i])]
        grid(shown, scale=4).save(args.grid)
        print(f"\nsamples of the first {min(4, len(prompts))} prompts: {args.grid}")


if __name__ == "__main__":
    main()
