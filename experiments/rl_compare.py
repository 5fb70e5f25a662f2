"""The RL methods side by side at equal rollout budgets, as the papers draw them: GenEval against rollouts
(videos generated), 3 seeds each, every point scored on 3 independent evaluation sets, a mean line and a min–max
band per method, and a Markdown table per set and pooled.

Methods (each a config of ``configs/``, run as it is in the repository, through ``PosttrainCLI``):

- on user requests (``datamodules.Requests``, reward ``IntentReward``: the request's facts), scored by
  *request-GenEval*: every fact a request asks is shown ("all asked facts"), through the method's serving path;
  ``prompt_rl`` (the refiner trains, the generator is frozen), ``generator_rl`` (the generator trains, served
  through the frozen refiner), ``flow_grpo_requests`` (Flow-GRPO served the requests verbatim: PromptRL's
  flow-only RL), ``unified_rl`` (joint, N = 1) and ``joint_rl`` (joint, N = 3, one concern
  each, per-expert credit);
- on captions, scored by caption GenEval (all four facts): ``flow_grpo`` and ``diffusion_nft``.

Equal budgets: every run trains ``--videos`` rollouts (3200; iterations = videos / (batch_size × K) of its config),
so every curve ends at the same number of videos. Every point of a curve is evaluated on ``EVAL_SETS``: 3 sets of
64 requests, each drawn with its own seed (no training run draws those seeds), in the training wording (``seen``)
and as held-out paraphrases of the same facts (``paraphrase``: held-out words and templates), the noise of a set's
batch ``i`` from its own ``noise_seed + i``. Beside each score the generator alone on the 64 canonical captions of
those facts (caption GenEval, all facts and shape: the generator must not get quietly worse) and the Fréchet VAE
distance of those samples to the rendered videos of the same captions; with refiners, their greedy rewrite accuracy
(``modules.requests.accuracy``) on both wordings, and request-GenEval with the same system served greedy rewrites
(``refiners.serve: greedy``; the headline serves as the config does). ``--control`` adds one run per method at
learning rate 0 (every optimizer's, every iteration): the same rollouts and evaluations, no learning.

The report gives each set (mean over seeds [min–max]) and the pooled figure (mean over seeds and sets ± its 95%
interval: the seeds' spread and the requests' binomial error, ``pooled``). A claim holds only when it holds pooled
AND points the same way on every set; one decided within the pooled interval is "not established".

    python -m experiments.rl_compare                             # every method, 3 seeds, controls
    python -m experiments.rl_compare --methods unified_rl generator_rl --seeds 0
    python -m experiments.rl_compare --plot-only                 # table and PNG from the saved runs

Each run is saved as ``<out>/<method>_s<seed>.json`` (``_control``) and skipped when present (``--rerun``
redoes it), so a re-run after a config changes redoes only ``--rerun --methods <it>``. Writes
``<out>/rl_compare.md`` and ``docs/rl/rl_compare.png``, and puts the table into the page beside the PNG
(``docs/rl/rl_compare.md``) between its ``<!-- rl_compare: table -->`` and ``<!-- rl_compare: end of table -->``
lines, the page's own text around them kept.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
from lightning.pytorch import Callback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL_PROMPTS, BATCH, VIDEOS = 64, 16, 3200
# (request seed, noise seed) of each evaluation set; the first is the one this bench always used
EVAL_SETS = ((11, 5000), (23, 6000), (37, 7000))
EVAL_SEED, NOISE_SEED = EVAL_SETS[0]
Z95 = 1.96


@dataclass(frozen=True)
class Method:
    config: str
    kind: str  # "requests" or "captions"
    label: str


METHODS = {
    "prompt_rl": Method("prompt_rl.yaml", "requests", "prompt-only RL (refiner; generator frozen)"),
    "generator_rl": Method("generator_rl.yaml", "requests", "generator-only RL (through the frozen refiner)"),
    "flow_grpo_requests": Method("flow_grpo_requests.yaml", "requests", "generator-only RL (requests verbatim)"),
    "unified_rl": Method("unified_rl.yaml", "requests", "joint RL, N = 1 (refiner + generator)"),
    "joint_rl": Method("joint_rl.yaml", "requests", "joint RL, N = 3 (per-expert credit)"),
    "flow_grpo": Method("flow_grpo.yaml", "captions", "Flow-GRPO (captions)"),
    "diffusion_nft": Method("diffusion_nft.yaml", "captions", "DiffusionNFT (captions)"),
}


# ------------------------------------------------------------------------------------------------ evaluation
class EvalSet:
    """One evaluation set: held-out requests drawn with ``seed`` (two wordings of the same facts), the captions of
    those facts and the captions' rendered videos; batch ``i`` is generated from noise seed ``noise_seed + i``."""

    def __init__(self, num: int = EVAL_PROMPTS, frames: int = 5, height: int = 32, width: int = 32,
                 seed: int = EVAL_SEED, noise_seed: int = NOISE_SEED):
        from posttrain.datamodules.requests import RequestDataset
        from posttrain.datamodules.synthetic import PRETRAIN_EXCLUDE, ShapesDataset
        from posttrain.modules.world.world import caption

        self.seed, self.noise_seed = seed, noise_seed
        self.requests = {name: [RequestDataset(num, seed=seed, split=split, exclude=PRETRAIN_EXCLUDE).request(i)
                                for i in range(num)] for name, split in (("seen", "train"), ("paraphrase", "eval"))}
        data = ShapesDataset(num, frames, height, width, seed=seed, exclude=PRETRAIN_EXCLUDE)
        self.captions = [caption(*data.facts(i)) for i in range(num)]
        self.real = torch.stack([data[i]["video"] for i in range(num)])
        self.size = (frames, height, width)

    @property
    def name(self) -> str:
        return f"set {self.seed}/{self.noise_seed}"

    def noise_seeds(self) -> range:
        return range(self.noise_seed, self.noise_seed + math.ceil(len(self.captions) / BATCH))


def eval_sets(frames: int, height: int, width: int, num: int = EVAL_PROMPTS) -> list[EvalSet]:
    """The ``EVAL_SETS``, at a method's video size."""
    return [EvalSet(num, frames, height, width, seed, noise) for seed, noise in EVAL_SETS]


def geneval_of(videos: list[torch.Tensor], facts) -> dict[str, float]:
    from posttrain.modules.world.geneval import judge_facts
    from posttrain.modules.world.requests import accuracy

    verdicts = judge_facts(torch.cat(videos), facts)
    return accuracy(verdicts)


@torch.no_grad()
def evaluate(module, kind: str, data: EvalSet) -> dict[str, float]:
    """The scores of one point of a curve (module docstring)."""
    from posttrain.lit.base import ExpertModule
    from posttrain.lit.joint_rl import JointRL
    from posttrain.modules.eval.frechet import VideoFrechetDistance
    from posttrain.modules.world.requests import CONCERN_TEMPLATES, accuracy, refine, rewrite_verdicts
    from posttrain.modules.world.world import parse_caption

    was_training = module.training
    module.eval()
    out: dict[str, float] = {}
    seeds = data.noise_seeds()
    # the generator alone on captions (any method): caption GenEval and the Fréchet VAE distance to the data
    frechet = VideoFrechetDistance(reset_real_features=True)
    videos = []
    for seed, i in zip(seeds, range(0, len(data.captions), BATCH)):
        batch = ExpertModule.generate(module, data.captions[i:i + BATCH], seed=seed).float()
        frechet.update(data.real[i:i + BATCH], real=True)
        frechet.update(batch.clamp(-1, 1), real=False)
        videos.append(batch)
    for key, value in geneval_of(videos, [parse_caption(c) for c in data.captions]).items():
        out[f"caption/{key}"] = value
    out["frechet"] = round(float(frechet.compute()), 4)
    if kind == "requests":  # the system as it serves: through its refiners (JointRL) or the request verbatim
        for wording, requests in data.requests.items():
            texts, facts = [r.text for r in requests], [r.facts for r in requests]
            served = lambda: [module.generate(texts[i:i + BATCH], seed=seed).float()  # noqa: E731
                              for seed, i in zip(seeds, range(0, len(texts), BATCH))]
            for key, value in geneval_of(served(), facts).items():
                out[f"{wording}/{key}"] = value
            if isinstance(module, JointRL) and wording == "seen":  # the same system served greedy rewrites
                serve, module.refiner_args.serve = module.refiner_args.serve, "greedy"
                try:
                    out["seen_greedy/all"] = geneval_of(served(), facts)["all"]
                finally:
                    module.refiner_args.serve = serve
            if isinstance(module, JointRL):
                for name in module.card.refiners:
                    lm, tok = module.card[name], module.card.tokenizers[name]
                    concerns = module.refiner_args.concerns
                    concern = concerns[module.card.refiners.index(name)] if concerns else None
                    template = CONCERN_TEMPLATES[concern] if concern else module.templates[name]
                    rewrites = refine(lm, tok, texts, template, max_new_tokens=module.max_new_tokens[name])
                    scores = accuracy(rewrite_verdicts(rewrites, facts, concern))
                    for key in ("all", "shape", "colour", "background", "motion"):
                        if not math.isnan(scores[key]):
                            out[f"rewrite/{wording}/{name}/{key}"] = scores[key]
    module.train(was_training)
    return out


class Curve(Callback):
    """Evaluates on every set at iteration 0 and at each of ``points``; counts videos generated (prompts × K per
    iteration) and the training's own CPU time (evaluation excluded). With ``control``, every optimizer's learning
    rate is 0."""

    def __init__(self, kind: str, sets: list[EvalSet], points: list[int], control: bool = False):
        self.kind, self.sets, self.points, self.control = kind, sets, set(points), control
        self.rows: list[dict] = []
        self.iterations, self.videos, self.train_cpu, self.train_wall = 0, 0, 0.0, 0.0
        self._t0 = None

    def _lr_zero(self, trainer) -> None:
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = 0.0
                group["initial_lr"] = 0.0
        for config in trainer.lr_scheduler_configs:
            config.scheduler.base_lrs = [0.0 for _ in config.scheduler.base_lrs]

    def _record(self, trainer, module) -> None:
        row = {"iteration": self.iterations, "videos": self.videos, "train_cpu_s": round(self.train_cpu, 1),
               "train_wall_s": round(self.train_wall, 1)}
        start = time.time()
        row["sets"] = {data.name: evaluate(module, self.kind, data) for data in self.sets}
        row["eval_wall_s"] = round(time.time() - start, 1)
        self.rows.append(row)
        key = "seen/all" if self.kind == "requests" else "caption/all"
        scores = " ".join(f"{row['sets'][d.name][key]:.3f}" for d in self.sets)
        captions = " ".join(f"{row['sets'][d.name]['caption/all']:.3f}" for d in self.sets)
        print(f"  it {row['iteration']:4d}  videos {self.videos:5d}  {key} per set {scores}  caption/all {captions}  "
              f"(train {self.train_cpu:.0f} CPU-s)", flush=True)

    def on_train_start(self, trainer, module) -> None:
        if self.control:
            self._lr_zero(trainer)
        self._record(trainer, module)

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if self.control:
            self._lr_zero(trainer)
        self._t0 = (time.process_time(), time.time())

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        cpu, wall = self._t0
        self.train_cpu += time.process_time() - cpu
        self.train_wall += time.time() - wall
        self.iterations += 1
        self.videos += len(batch["prompt"]) * module.grpo.num_samples_per_prompt
        if self.iterations in self.points:
            self._record(trainer, module)


def method_cli(name: str, seed: int, *extra: str):
    """The CLI (not run) of method ``name``'s config with ``seed`` for the global, the model's and the run's RNGs, no
    logger, and ``extra`` options; built from the repository root, where the configs' relative paths (the shipped
    refiner) point."""
    from posttrain.lit.tools.config import PosttrainCLI

    args = ["--config", os.path.join(ROOT, "configs", METHODS[name].config), f"--seed_everything={seed}",
            f"--model.init_args.run.seed={seed}", "--trainer.logger=false", *extra]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return PosttrainCLI(args=args, run=False)
    finally:
        os.chdir(cwd)


def run_one(name: str, seed: int, control: bool, videos: Optional[int], points: int, out: str,
            threads: int, overrides: tuple[str, ...] = (), num: int = EVAL_PROMPTS) -> dict:
    """One run of method ``name``: ``videos`` rollouts (None: its config's ``max_steps``), evaluated ``points``
    times besides iteration 0 on every evaluation set."""
    torch.set_num_threads(threads)
    method = METHODS[name]
    tag = f"{name}_s{seed}" + ("_control" if control else "")
    args = [f"--data.init_args.seed={seed}", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", "--trainer.limit_val_batches=0",
            f"--trainer.default_root_dir={os.path.join(out, 'runs', tag)}"]
    args += [f"--{o}" for o in overrides]
    cli = method_cli(name, seed, *args)
    trainer, module = cli.trainer, cli.model
    per_iteration = cli.datamodule.batch_size * module.grpo.num_samples_per_prompt
    if videos is not None:  # the equal budget: the same rollouts for every method, whatever its batch and K
        if videos % per_iteration:
            raise ValueError(f"--videos={videos} is not a multiple of {name}'s {per_iteration} rollouts an iteration "
                             f"(batch_size × K): pick a multiple of it")
        trainer.fit_loop.epoch_loop.max_steps = videos // per_iteration
    # the curve's evaluations replace the run's sample videos (and validation: limit_val_batches=0)
    trainer.callbacks = [c for c in trainer.callbacks if type(c).__name__ != "SampleVideos"]
    total = trainer.max_steps
    marks = sorted({max(1, round(total * (k + 1) / points)) for k in range(points)})
    curve = Curve(method.kind, eval_sets(module.video.frames, module.video.height, module.video.width, num), marks,
                  control)
    trainer.callbacks.append(curve)
    before = {k: v.detach().clone() for k, v in module.card.state_dict().items()} if control else None
    start = time.time()
    trainer.fit(module, cli.datamodule)
    result = {"method": name, "seed": seed, "control": control, "iterations": trainer.global_step,
              "videos": curve.videos, "train_cpu_s": round(curve.train_cpu, 1), "wall_s": round(time.time() - start, 1),
              "eval_sets": [d.name for d in curve.sets], "rows": curve.rows, "config": method.config,
              "overrides": list(overrides)}
    if control:  # lr 0: nothing may have moved
        after = module.card.state_dict()
        result["weights_unchanged"] = all(torch.equal(v, after[k]) for k, v in before.items() if k in after)
    return result


# ------------------------------------------------------------------------------------------------ the report
PROPORTIONS = ("/all", "/shape", "/colour", "/background", "/motion")  # keys that are shares of 64 requests


def headline(method: Method) -> str:
    return "seen/all" if method.kind == "requests" else "caption/all"


def load(out: str) -> dict[tuple[str, bool], list[dict]]:
    """The saved runs by (method, control); a run saved before the evaluation had several sets is refused."""
    runs: dict[tuple[str, bool], list[dict]] = {}
    for file in sorted(os.listdir(out)):
        if file.endswith(".json"):
            with open(os.path.join(out, file)) as f:
                r = json.load(f)
            if "eval_sets" not in r:
                raise ValueError(f"{os.path.join(out, file)} was scored on one evaluation set (an older bench); "
                                 f"rerun it with --rerun --methods {r['method']}, or point --out elsewhere")
            runs.setdefault((r["method"], r["control"]), []).append(r)
    return runs


def value(run: dict, index: int, key: str, where: Optional[str] = None) -> float:
    """``key`` at evaluation point ``index`` (-1: the last) on set ``where``, or the mean over sets (None)."""
    sets = run["rows"][index]["sets"]
    values = [sets[where].get(key, float("nan"))] if where else [v.get(key, float("nan")) for v in sets.values()]
    return sum(values) / len(values)


@dataclass
class Pooled:
    """A pooled figure (mean over seeds and sets) or a difference of two, its 95% half-width and each set's mean."""

    mean: float
    half: float
    per_set: dict[str, float]

    def verdict(self, what: str = "") -> str:
        """Holds only when the pooled interval is above 0 AND every set points the same way."""
        against = [name for name, v in self.per_set.items() if not v > 0]
        if self.mean - self.half > 0 and not against:
            return "holds"
        if self.mean + self.half < 0:
            return "does not hold (the opposite is measured pooled)"
        if self.mean - self.half > 0:
            return f"does not hold: pooled yes, but {', '.join(against)} point the other way"
        return f"does not hold: not established (pooled {self.mean:+.3f} ± {self.half:.3f})"

    def text(self) -> str:
        sets = " / ".join(f"{v:+.3f}" for v in self.per_set.values())
        return f"{self.mean:+.3f} ± {self.half:.3f} pooled (per set {sets})"


def pooled(a: list[float], b: Optional[list[float]] = None, *, key: str, per_set: dict[str, float],
           binomial: list[float] = ()) -> Pooled:
    """Mean of ``a`` (per-seed figures, each pooled over the sets) minus the mean of ``b``, with a 95% interval from
    the seeds' spread (variance of the mean over seeds, each side) and, for a share of requests, the requests'
    binomial error p(1 − p) / (sets × 64) of every share in ``binomial`` (counted unpaired: conservative for a
    before → after difference on the same requests and noise); for a distance (Fréchet), the spread of
    ``per_set`` over the sets instead."""
    def mean_var(xs: list[float]) -> tuple[float, float]:
        m = sum(xs) / len(xs)
        return m, (sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs) if len(xs) > 1 else 0.0)

    mean, var = mean_var(a)
    if b is not None:
        mb, vb = mean_var(b)
        mean, var = mean - mb, var + vb
    if key.endswith(PROPORTIONS):
        sets = len(EVAL_SETS)
        var += sum(p * (1 - p) / (sets * EVAL_PROMPTS) for p in binomial)
    elif len(per_set) > 1:  # a distance: the sets' spread stands for the evaluation's error
        m = sum(per_set.values()) / len(per_set)
        var += sum((v - m) ** 2 for v in per_set.values()) / (len(per_set) - 1) / len(per_set)
    return Pooled(mean, Z95 * math.sqrt(var), per_set)


def set_names(runs: list[dict]) -> list[str]:
    return runs[0]["eval_sets"]


def gain(runs: list[dict], key: str) -> Pooled:
    """After − before of ``key`` (pooled over sets, then over seeds)."""
    per_set = {w: sum(value(r, -1, key, w) - value(r, 0, key, w) for r in runs) / len(runs) for w in set_names(runs)}
    before, after = [value(r, 0, key) for r in runs], [value(r, -1, key) for r in runs]
    return pooled([x - y for x, y in zip(after, before)], key=key, per_set=per_set,
                  binomial=[sum(before) / len(before), sum(after) / len(after)])


def final_gap(a: list[dict], b: list[dict], key: str) -> Pooled:
    """``a``'s final ``key`` − ``b``'s (equal budgets: the same videos)."""
    per_set = {w: sum(value(r, -1, key, w) for r in a) / len(a) - sum(value(r, -1, key, w) for r in b) / len(b)
               for w in set_names(a)}
    fa, fb = [value(r, -1, key) for r in a], [value(r, -1, key) for r in b]
    return pooled(fa, fb, key=key, per_set=per_set, binomial=[sum(fa) / len(fa), sum(fb) / len(fb)])


def band(runs: list[dict], key: str, where: Optional[str] = None):
    """Videos, mean, min and max of ``key`` (on set ``where``, or pooled over sets) over seeds at each evaluation
    point (points shared by all seeds)."""
    n = min(len(r["rows"]) for r in runs)
    videos = [runs[0]["rows"][i]["videos"] for i in range(n)]
    values = [[value(r, i, key, where) for r in runs] for i in range(n)]
    return videos, [sum(v) / len(v) for v in values], [min(v) for v in values], [max(v) for v in values]


def cell(runs: list[dict], key: str, where: Optional[str]) -> str:
    """``before → after`` of ``key`` on one set (after: mean [min–max] over seeds) or pooled (Δ ± 95%)."""
    if key not in runs[0]["rows"][0]["sets"][set_names(runs)[0]]:
        return "–"
    before = sum(value(r, 0, key, where) for r in runs) / len(runs)
    after = [value(r, -1, key, where) for r in runs]
    text = f"{before:.3f} → {sum(after) / len(after):.3f}"
    if where is not None:
        return text + (f" [{min(after):.3f}–{max(after):.3f}]" if len(after) > 1 else "")
    g = gain(runs, key)
    return text + f" (Δ {g.mean:+.3f} ± {g.half:.3f})"


def rewrite_keys(runs: list[dict]) -> list[str]:
    first = runs[0]["rows"][0]["sets"][set_names(runs)[0]]
    return sorted(k for k in first if k.startswith("rewrite/seen/") and k.endswith("/all"))


def report(out: str, png: str) -> str:
    runs = load(out)
    lines = ["| method | evaluation set | seeds | iterations | videos | score before → after | control after | "
             "paraphrase before → after | served greedy rewrites | refiner rewrite accuracy, greedy, seen wording | "
             "caption GenEval | caption shape | Fréchet | train CPU-s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, method in METHODS.items():
        trained = runs.get((name, False))
        if not trained:
            continue
        key, control = headline(method), runs.get((name, True))
        cpus = [r["train_cpu_s"] for r in trained]
        for where in [*set_names(trained), None]:
            control_text = "–"
            if control:
                control_text = f"{sum(value(r, -1, key, where) for r in control) / len(control):.3f}"
            rewrite = "; ".join(f"{k.split('/')[2]} {cell(trained, k, where)}" for k in rewrite_keys(trained)) or "–"
            para = cell(trained, "paraphrase/all", where) if method.kind == "requests" else "–"
            label = f"**{method.label}**" if where is None else method.label
            cpu = f"{sum(cpus) / len(cpus):.0f} [{min(cpus):.0f}–{max(cpus):.0f}]" if where is None else ""
            lines.append(f"| {label} | {where or '**pooled**'} | {len(trained)} | {trained[0]['iterations']} | "
                         f"{trained[0]['videos']} | {cell(trained, key, where)} | {control_text} | {para} | "
                         f"{cell(trained, 'seen_greedy/all', where)} | {rewrite} | "
                         f"{cell(trained, 'caption/all', where)} | {cell(trained, 'caption/shape', where)} | "
                         f"{cell(trained, 'frechet', where)} | {cpu} |")
    lines += ["", "Claims (a claim holds only when it holds pooled, its 95% interval above 0, AND points the same way "
              "on every evaluation set):"]
    lines += claims(runs)
    plot(runs, png)
    return "\n".join(lines)


def videos_to_reach(runs: list[dict], key: str, target: float, where: Optional[str] = None) -> Optional[float]:
    """Videos at which the seed-mean curve of ``key`` (on set ``where`` or pooled) first reaches ``target``
    (linear between points); None when it never does within its budget."""
    videos, mean, _, _ = band(runs, key, where)
    for i, m in enumerate(mean):
        if m >= target:
            if i == 0:
                return 0.0
            v0, m0 = videos[i - 1], mean[i - 1]
            return v0 + (videos[i] - v0) * (target - m0) / (m - m0)
    return None


def claims(runs) -> list[str]:
    def reach(fast: str, slow: str, key: str, factor: float) -> str:
        a, b = runs.get((fast, False)), runs.get((slow, False))
        if not a or not b:
            return f"- {fast} vs {slow}: not run"
        budgets = {r["videos"] for r in a + b}
        ratios = {}
        for where in [None, *set_names(b)]:
            target = sum(value(r, -1, key, where) for r in b) / len(b)
            got = videos_to_reach(a, key, target, where)
            ratios[where or "pooled"] = (b[0]["videos"] / got if got else math.inf) if got is not None else 0.0
        worth = gain(b, key)  # what the slow method's final score is worth: its own gain
        at_equal = final_gap(a, b, key)
        if len(budgets) > 1:
            verdict = f"is not comparable: unequal budgets {sorted(budgets)} videos"
        elif worth.mean - worth.half <= 0:
            verdict = f"is not established: {slow}'s own gain {worth.text()} is within its interval"
        elif all(r >= factor for r in ratios.values()):
            verdict = "holds"
        else:
            short = [w for w, r in ratios.items() if r < factor]
            verdict = f"does not hold ({', '.join(short)} below {factor:g}×)"
        text = ", ".join(f"{w} {'never' if r == 0 else f'{r:.1f}×'}" for w, r in ratios.items())
        return (f"- {fast} reaches {slow}'s final {key} in fewer rollouts ({text}; seeds {len(a)} vs {len(b)}): the "
                f"≥ {factor:g}× claim {verdict}. At the equal budget ({b[0]['videos']} videos) {fast} − {slow}: "
                f"{at_equal.text()}: {at_equal.verdict()}")

    lines = [reach("diffusion_nft", "flow_grpo", "caption/all", 3.0)]
    for fast in ("unified_rl", "joint_rl"):
        for baseline in ("generator_rl", "flow_grpo_requests", "prompt_rl"):  # PromptRL's two single arms, RePrompt's
            lines.append(reach(fast, baseline, "seen/all", 2.0))
    joint = runs.get(("unified_rl", False))
    for baseline in ("generator_rl", "flow_grpo_requests", "prompt_rl"):
        base = runs.get((baseline, False))
        if joint and base:
            gj, gb = gain(joint, "paraphrase/all"), gain(base, "paraphrase/all")
            diff = Pooled(gj.mean - gb.mean, math.hypot(gj.half, gb.half),
                          {w: gj.per_set[w] - gb.per_set[w] for w in gj.per_set})
            lines.append(f"- held-out paraphrases: joint RL (N = 1) gains {gj.text()}, {baseline} {gb.text()}; "
                         f"joint's gain is larger: {diff.verdict()}")
    n3 = runs.get(("joint_rl", False))
    if n3:
        for k in rewrite_keys(n3):
            g = gain(n3, k)
            lines.append(f"- joint RL N = 3: {k.split('/')[2]} improves its own concern's greedy rewrite accuracy "
                         f"(seen wording) {g.text()}: {g.verdict()}")
    # the generator must not get worse: caption GenEval (all, shape) within one evaluation's noise of its start
    for name, method in METHODS.items():
        trained = runs.get((name, False))
        if not trained:
            continue
        g = gain(trained, headline(method))
        lines.append(f"- {name} rises on {headline(method)} in {trained[0]['videos']} videos: {g.text()}: "
                     f"{g.verdict()}")
        for key in ("caption/all", "caption/shape"):
            worse = []
            for where in set_names(trained):
                before = value(trained[0], 0, key, where)
                after = sum(value(r, -1, key, where) for r in trained) / len(trained)
                noise = math.sqrt(max(before * (1 - before), 1e-9) / EVAL_PROMPTS)
                if after < before - noise:
                    worse.append(f"{where} {before:.3f} → {after:.3f} (noise ±{noise:.3f})")
            g = gain(trained, key)
            lines.append(f"- {name}: {key} {g.text()}; " + (f"WORSE by more than one evaluation's noise on "
                                                             f"{'; '.join(worse)}" if worse else
                                                             "within one evaluation's noise of its start or better on "
                                                             "every set"))
        f = gain(trained, "frechet")
        rises = sum(v > 0 for v in f.per_set.values())
        lines.append(f"- {name}: Fréchet {f.text()}, rises on {rises} of {len(f.per_set)} sets")
    return lines


def plot(runs, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("requests", "seen/all", "request-GenEval, held-out requests (all asked facts)"),
              ("requests", "paraphrase/all", "request-GenEval, held-out paraphrases"),
              ("captions", "caption/all", "caption GenEval (generator alone, all four facts)")]
    if not any(METHODS[name].kind == "requests" for name, _ in runs):  # caption methods only: their one panel
        panels = panels[2:]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.8 * len(panels), 4.8), squeeze=False)
    axes = axes[0]
    for ax, (kind, key, title) in zip(axes, panels):
        for i, (name, method) in enumerate(METHODS.items()):
            trained = runs.get((name, False))
            if not trained or (kind == "requests" and method.kind != "requests"):
                continue
            videos, mean, low, high = band(trained, key)
            colour = f"C{i}"
            ax.plot(videos, mean, marker="o", ms=3, color=colour, label=f"{method.label} ({len(trained)} seeds)")
            ax.fill_between(videos, low, high, color=colour, alpha=0.18)
            control = runs.get((name, True))
            if control:
                cv, cm, _, _ = band(control, key)
                ax.plot(cv, cm, ls=":", color=colour, lw=1)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("rollouts (videos generated)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy")
    axes[-1].legend(fontsize=7, loc="best")
    controls = any(control for _, control in runs)
    joiner = ", " if len(panels) > 1 else "\n"  # one panel: the title on three lines, within the figure
    fig.suptitle(f"posttrain RL on the synthetic world: pooled over {len(EVAL_SETS)} evaluation sets,{joiner[-1]}"
                 "mean over seeds, band = min–max"
                 + (f"{joiner}dotted = learning rate 0" if controls else f"{joiner}(no learning-rate-0 control run)"),
                 fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(png), exist_ok=True)
    fig.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--control", action=argparse.BooleanOptionalAction, default=True,
                        help="one run per method at learning rate 0 (seed of the first --seeds)")
    parser.add_argument("--videos", type=int, default=VIDEOS,
                        help="the equal budget: rollouts every run trains (iterations = videos / (batch_size × K)); "
                             "0 = each config's own max_steps (unequal budgets: reach claims are then refused)")
    parser.add_argument("--num-eval", type=int, default=EVAL_PROMPTS, help="requests per evaluation set (pilots)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="extra config overrides for every run (pilots), e.g. "
                             "model.init_args.refiners.temperature=0.7")
    parser.add_argument("--points", type=int, default=6, help="evaluations along a run, besides iteration 0")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "rl_compare_sets"))
    parser.add_argument("--png", default=os.path.join(ROOT, "docs", "rl", "rl_compare.png"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rerun", action="store_true", help="redo runs whose JSON exists")
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    start = time.time()
    if not args.plot_only:
        jobs = [(m, s, False) for m in args.methods for s in args.seeds]
        jobs += [(m, args.seeds[0], True) for m in args.methods if args.control]
        for name, seed, control in jobs:
            path = os.path.join(args.out, f"{name}_s{seed}" + ("_control" if control else "") + ".json")
            if os.path.exists(path) and not args.rerun:
                continue
            print(f"{name} seed {seed}{' (learning rate 0)' if control else ''}", flush=True)
            result = run_one(name, seed, control, args.videos or None, args.points, args.out, args.threads,
                             tuple(args.set), args.num_eval)
            with open(path + ".tmp", "w") as f:
                json.dump(result, f, indent=1)
            os.replace(path + ".tmp", path)
    table = report(args.out, args.png)
    with open(os.path.join(args.out, "rl_compare.md"), "w") as f:
        f.write(table + "\n")
    write_between_marks(os.path.splitext(args.png)[0] + ".md", table)  # docs/rl/rl_compare.png -> .md
    print(table)
    print(f"\n(bench wall time {time.time() - start:.0f} s; {args.png})")


BEGIN, END = "<!-- rl_compare: table -->", "<!-- rl_compare: end of table -->"


def write_between_marks(path: str, table: str) -> None:
    """``table`` into the page ``path`` between its ``BEGIN`` and ``END`` lines, the page's own text around them
    kept; a page without them (or none yet) becomes the table between the marks."""
    text = open(path).read() if os.path.exists(path) else ""
    if BEGIN in text and END in text:
        before, rest = text.split(BEGIN, 1)
        text = before + BEGIN + "\n" + table + "\n" + END + rest.split(END, 1)[1]
    else:
        text = BEGIN + "\n" + table + "\n" + END + "\n"
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())
