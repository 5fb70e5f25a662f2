"""The RL methods side by side at equal rollout budgets, as the papers draw them: GenEval against rollouts
(videos generated), 3 seeds each, a mean line and a min–max band per method, and a Markdown table.

Methods (each a config of ``configs/``, run as it is in the repository, through ``PosttrainCLI``):

- on user requests (``datamodules.Requests``, reward ``IntentReward``: the request's facts), scored by
  *request-GenEval*: every fact a request asks is shown ("all asked facts"), through the method's serving path;
  ``prompt_rl`` (the refiner trains, the generator is frozen), ``generator_rl`` (the generator trains, served
  through the frozen refiner), ``flow_grpo_requests`` (Flow-GRPO served the requests verbatim: PromptRL's
  flow-only RL), ``unified_rl`` (joint, N = 1) and ``joint_rl`` (joint, N = 3, one concern
  each, per-expert credit);
- on captions, scored by caption GenEval (all four facts): ``flow_grpo`` and ``diffusion_nft``.

Every point of a curve is evaluated on requests and noise never trained on: 64 requests of facts drawn with
``EVAL_SEED`` (no training run draws that seed; a request whose text a training run could write is counted
and reported), in the training wording (``seen``) and as held-out paraphrases of the same facts
(``paraphrase``: held-out words and templates); the noise of batch ``i`` from seed ``NOISE_SEED + i``. Beside
each score the generator alone on the 64 canonical captions of those facts (caption GenEval: the generator
must not get quietly worse) and the Fréchet VAE distance of those samples to the rendered videos of the same
captions; with refiners, their greedy rewrite accuracy (``modules.requests.accuracy``) on both wordings.
``--control`` adds one run per method at learning rate 0 (every optimizer's, every iteration): the same
rollouts and evaluations, no learning.

    python -m experiments.rl_compare                             # every method, 3 seeds, controls
    python -m experiments.rl_compare --methods unified_rl generator_rl --seeds 0
    python -m experiments.rl_compare --plot-only                 # table and PNG from the saved runs

Each run is saved as ``<out>/<method>_s<seed>.json`` (``_control``) and skipped when present (``--rerun``
redoes it), so a re-run after a config changes redoes only ``--rerun --methods <it>``. Writes
``<out>/rl_compare.md`` and ``docs/rl/rl_compare.png`` (with the table beside it, named after the PNG:
``docs/rl/rl_compare.md``).
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
EVAL_SEED, NOISE_SEED, EVAL_PROMPTS, BATCH = 11, 5000, 64, 16


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
    """The held-out requests (two wordings of the same facts), their captions and the captions' rendered videos."""

    def __init__(self, num: int = EVAL_PROMPTS, frames: int = 5, height: int = 32, width: int = 32):
        from posttrain.datamodules.requests import RequestDataset
        from posttrain.datamodules.synthetic import PRETRAIN_EXCLUDE, ShapesDataset
        from posttrain.modules.world.world import caption

        self.requests = {name: [RequestDataset(num, seed=EVAL_SEED, split=split, exclude=PRETRAIN_EXCLUDE).request(i)
                                for i in range(num)] for name, split in (("seen", "train"), ("paraphrase", "eval"))}
        data = ShapesDataset(num, frames, height, width, seed=EVAL_SEED, exclude=PRETRAIN_EXCLUDE)
        self.captions = [caption(*data.facts(i)) for i in range(num)]
        self.real = torch.stack([data[i]["video"] for i in range(num)])
        self.size = (frames, height, width)


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
    seeds = range(NOISE_SEED, NOISE_SEED + math.ceil(len(data.captions) / BATCH))
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
            videos = [module.generate(texts[i:i + BATCH], seed=seed).float()
                      for seed, i in zip(seeds, range(0, len(texts), BATCH))]
            for key, value in geneval_of(videos, facts).items():
                out[f"{wording}/{key}"] = value
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
    """Evaluates at iteration 0 and at each of ``points``; counts videos generated (prompts × K per iteration) and
    the training's own CPU time (evaluation excluded). With ``control``, every optimizer's learning rate is 0."""

    def __init__(self, kind: str, data: EvalSet, points: list[int], control: bool = False):
        self.kind, self.data, self.points, self.control = kind, data, set(points), control
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
        row.update(evaluate(module, self.kind, self.data))
        row["eval_wall_s"] = round(time.time() - start, 1)
        self.rows.append(row)
        headline = row.get("seen/all", row["caption/all"])
        print(f"  it {row['iteration']:4d}  videos {self.videos:5d}  score {headline:.3f}  caption "
              f"{row['caption/all']:.3f}  frechet {row['frechet']:.3f}  (train {self.train_cpu:.0f} CPU-s)", flush=True)

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


def run_one(name: str, seed: int, control: bool, iterations: Optional[int], points: int, out: str,
            threads: int, overrides: tuple[str, ...] = ()) -> dict:
    torch.set_num_threads(threads)
    method = METHODS[name]
    tag = f"{name}_s{seed}" + ("_control" if control else "")
    args = [f"--data.init_args.seed={seed}", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", "--trainer.limit_val_batches=0",
            f"--trainer.default_root_dir={os.path.join(out, 'runs', tag)}"]
    if iterations is not None:
        args.append(f"--trainer.max_steps={iterations}")
    args += [f"--{o}" for o in overrides]
    cli = method_cli(name, seed, *args)
    trainer, module = cli.trainer, cli.model
    # the curve's evaluations replace the run's sample videos (and validation: limit_val_batches=0)
    trainer.callbacks = [c for c in trainer.callbacks if type(c).__name__ != "SampleVideos"]
    total = trainer.max_steps
    marks = sorted({max(1, round(total * (k + 1) / points)) for k in range(points)})
    curve = Curve(method.kind, EvalSet(frames=module.video.frames, height=module.video.height,
                                       width=module.video.width), marks, control)
    trainer.callbacks.append(curve)
    before = {k: v.detach().clone() for k, v in module.card.state_dict().items()} if control else None
    start = time.time()
    trainer.fit(module, cli.datamodule)
    result = {"method": name, "seed": seed, "control": control, "iterations": trainer.global_step,
              "videos": curve.videos, "train_cpu_s": round(curve.train_cpu, 1), "wall_s": round(time.time() - start, 1),
              "rows": curve.rows, "config": method.config}
    if control:  # lr 0: nothing may have moved
        after = module.card.state_dict()
        result["weights_unchanged"] = all(torch.equal(v, after[k]) for k, v in before.items() if k in after)
    return result


# ------------------------------------------------------------------------------------------------ the report
def headline(method: Method) -> str:
    return "seen/all" if method.kind == "requests" else "caption/all"


def load(out: str) -> dict[tuple[str, bool], list[dict]]:
    runs: dict[tuple[str, bool], list[dict]] = {}
    for file in sorted(os.listdir(out)):
        if file.endswith(".json"):
            with open(os.path.join(out, file)) as f:
                r = json.load(f)
            runs.setdefault((r["method"], r["control"]), []).append(r)
    return runs


def band(runs: list[dict], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """Videos, mean, min and max of ``key`` over seeds at each evaluation point (points shared by all seeds)."""
    n = min(len(r["rows"]) for r in runs)
    videos = [runs[0]["rows"][i]["videos"] for i in range(n)]
    values = [[r["rows"][i].get(key, float("nan")) for r in runs] for i in range(n)]
    return videos, [sum(v) / len(v) for v in values], [min(v) for v in values], [max(v) for v in values]


def interval(values: list[float]) -> str:
    return f"{sum(values) / len(values):.3f} [{min(values):.3f}–{max(values):.3f}]"


def videos_to_reach(runs: list[dict], key: str, target: float) -> Optional[float]:
    """Videos at which the seed-mean curve of ``key`` first reaches ``target`` (linear between points)."""
    videos, mean, _, _ = band(runs, key)
    for i, value in enumerate(mean):
        if value >= target:
            if i == 0:
                return 0.0
            v0, m0 = videos[i - 1], mean[i - 1]
            return v0 + (videos[i] - v0) * (target - m0) / (value - m0)
    return None


def report(out: str, png: str) -> str:
    runs = load(out)
    lines = ["| method | config | seeds | iterations | videos | score before | score after | control after | "
             "paraphrase before → after | refiner rewrite accuracy before → after | caption GenEval before → after | "
             "Fréchet before → after | train CPU-s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, method in METHODS.items():
        trained = runs.get((name, False))
        if not trained:
            continue
        key = headline(method)
        first = [r["rows"][0][key] for r in trained]
        last = [r["rows"][-1][key] for r in trained]
        control = runs.get((name, True))
        control_text = interval([r["rows"][-1][key] for r in control]) if control else "–"
        para = "–"
        if method.kind == "requests":
            para = f"{interval([r['rows'][0]['paraphrase/all'] for r in trained])} → " \
                   f"{interval([r['rows'][-1]['paraphrase/all'] for r in trained])}"
        caption = f"{interval([r['rows'][0]['caption/all'] for r in trained])} → " \
                  f"{interval([r['rows'][-1]['caption/all'] for r in trained])}"
        frechet = f"{interval([r['rows'][0]['frechet'] for r in trained])} → " \
                  f"{interval([r['rows'][-1]['frechet'] for r in trained])}"
        rewrite = "–"
        keys = sorted(k for k in trained[0]["rows"][0] if k.startswith("rewrite/") and k.endswith("/all"))
        if keys:  # greedy rewrite accuracy of each refiner, seen and held-out wording
            rewrite = "; ".join(f"{k[len('rewrite/'):-len('/all')]} {interval([r['rows'][0][k] for r in trained])} → "
                                f"{interval([r['rows'][-1][k] for r in trained])}" for k in keys)
        cpus = [r["train_cpu_s"] for r in trained]
        cpu = f"{sum(cpus) / len(cpus):.0f} [{min(cpus):.0f}–{max(cpus):.0f}]"
        lines.append(f"| {method.label} | `configs/{method.config}` | {len(trained)} | {trained[0]['iterations']} | "
                     f"{trained[0]['videos']} | {interval(first)} | {interval(last)} | {control_text} | {para} | {rewrite} | "
                     f"{caption} | {frechet} | {cpu} |")
    lines += ["", "Claims:"]
    lines += claims(runs)
    plot(runs, png)
    return "\n".join(lines)


def claims(runs) -> list[str]:
    se = math.sqrt(0.3 * 0.7 / EVAL_PROMPTS)

    def verdict_of(holds: bool, gap: float, seeds: int) -> str:
        """A claim is evidence only when what decides it exceeds one evaluation's sampling error, on ≥ 3 seeds."""
        if not holds:
            return "does not reproduce"
        if gap <= se:
            return f"is not established (decided by {gap:.3f}, within ±{se:.3f})"
        if seeds < 3:
            return "is not established (fewer than 3 seeds a side)"
        return "reproduces"

    def reach(fast: str, slow: str, key: str, factor: float) -> str:
        a, b = runs.get((fast, False)), runs.get((slow, False))
        if not a or not b:
            return f"- {fast} vs {slow}: not run"
        target = sum(r["rows"][-1][key] for r in b) / len(b)
        budget = b[0]["videos"]
        got = videos_to_reach(a, key, target)
        ratio = budget / got if got else math.inf
        gain = target - sum(r["rows"][0][key] for r in b) / len(b)  # what the slow method's final score is worth
        verdict = verdict_of(got is not None and ratio >= factor, gain, min(len(a), len(b)))
        where = f"{got:.0f} videos ({ratio:.1f}× fewer)" if got is not None else "never within its budget"
        return (f"- {fast} reaches {slow}'s final {key} ({target:.3f}, at {budget} videos) at {where}: the ≥ "
                f"{factor:g}× claim {verdict} ({len(a)} vs {len(b)} seeds)")

    lines = [f"- (one evaluation's sampling error at a score of 0.3: ±{se:.3f}, {EVAL_PROMPTS} requests; a claim "
             f"decided by less than that, or on one seed, is not evidence)",
             reach("diffusion_nft", "flow_grpo", "caption/all", 3.0)]
    for baseline in ("generator_rl", "flow_grpo_requests", "prompt_rl"):  # PromptRL's two single arms, RePrompt's
        lines.append(reach("unified_rl", baseline, "seen/all", 2.0))
    joint = runs.get(("unified_rl", False))
    for baseline in ("generator_rl", "flow_grpo_requests"):
        base = runs.get((baseline, False))
        if joint and base:
            gain = lambda rs, k: [r["rows"][-1][k] - r["rows"][0][k] for r in rs]  # noqa: E731
            g_base, g_joint = gain(base, "paraphrase/all"), gain(joint, "paraphrase/all")
            seen_base = gain(base, "seen/all")
            gap = sum(g_joint) / len(g_joint) - sum(g_base) / len(g_base)
            verdict = verdict_of(gap > 0, gap, min(len(joint), len(base)))
            lines.append(f"- on held-out paraphrases {baseline} gains {interval(g_base)} (seen wording "
                         f"{interval(seen_base)}), joint RL (N = 1) {interval(g_joint)}: the claim {verdict} "
                         f"({len(joint)} vs {len(base)} seeds)")
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
    joiner = ", " if len(panels) > 1 else "\n"  # one panel: the title on two lines, within the figure
    fig.suptitle("posttrain RL on the synthetic world: mean over seeds, band = min–max"
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
    parser.add_argument("--iterations", type=int, help="override every config's trainer.max_steps (pilots)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="extra config overrides for every run (pilots), e.g. "
                             "model.init_args.refiners.temperature=0.7")
    parser.add_argument("--points", type=int, default=6, help="evaluations along a run, besides iteration 0")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "rl_compare"))
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
            result = run_one(name, seed, control, args.iterations, args.points, args.out, args.threads,
                             tuple(args.set))
            with open(path + ".tmp", "w") as f:
                json.dump(result, f, indent=1)
            os.replace(path + ".tmp", path)
    table = report(args.out, args.png)
    beside_png = os.path.splitext(args.png)[0] + ".md"  # docs/rl/rl_compare.png -> docs/rl/rl_compare.md
    for path in (os.path.join(args.out, "rl_compare.md"), beside_png):
        with open(path, "w") as f:
            f.write(table + "\n")
    print(table)
    print(f"\n(bench wall time {time.time() - start:.0f} s; {args.png})")


if __name__ == "__main__":
    sys.exit(main())
