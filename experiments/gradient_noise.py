"""How much of an RL update is signal: the gradient noise scale of flow_grpo and diffusion_nft.

An RL step estimates the direction that raises the expected reward from one iteration's rollouts. When that
estimate is mostly noise, Adam still takes a step of about the learning rate in every weight (it normalises the
gradient's scale away), so the pretrained generator random-walks: its reward falls instead of rising. This bench
measures how much each method's estimate is signal, at the pretrained weights, on the shipped configs.

For each config, the real ``fit`` runs ``--iterations`` iterations at learning rate 0 (the weights never move, so
every iteration's gradient is an independent estimate at the same point: fresh captions, fresh noise; gradient
clipping at 1e30, so no step is rescaled), and a hook on the generator's optimizer records the gradient each step
would have taken. From the n per-iteration gradients g_i (McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training"):

- tr Σ = Σ_i |g_i − ḡ|² / (n − 1), the noise of one iteration's estimate;
- |G|² = |ḡ|² − tr Σ / n, an unbiased estimate of the squared norm of the expected gradient;
- the noise scale B = tr Σ / |G|², in iterations: how many iterations' rollouts one step would have to average for
  its signal to equal its noise (B ≤ 1: one iteration's step is mostly signal), also given in rollouts;
- the mean cosine between the gradients of two different iterations (≈ 1 / (1 + B) when the estimates agree).

B's interval takes |G|² within two jackknife standard errors (leave one iteration out); an upper end of ∞ means
|G|² could not be told from 0.
The last line is each config's noise scale in rollouts against the first config's (the baseline, same run).

    OMP_NUM_THREADS=1 python -m experiments.gradient_noise                   # diffusion_nft vs flow_grpo, 48 it.
    OMP_NUM_THREADS=1 python -m experiments.gradient_noise --configs diffusion_nft flow_grpo@2x4 flow_grpo \
        --set-for flow_grpo@2x4 data.init_args.batch_size=2 model.init_args.grpo.num_samples_per_prompt=4 \
        model.init_args.reward.init_args.total=mean                    # flow_grpo's earlier 2 x 4 beside it

A run is a config of configs/ with an optional ``@label`` (the same config twice, each with its own ``--set-for``).
"""
from __future__ import annotations

import argparse
import math
import tempfile
import time

import torch
from lightning.pytorch import Callback

from bench.noise_scale import gram_of, interval, mean_cosine, noise_scale
from experiments.rl_captions import build


class Gradients(Callback):
    """Records the generator's gradient at every optimizer step (a pre-step hook: after the method's backward)."""

    def __init__(self, expert: str = "transformer"):
        self.expert, self.grads, self.handle = expert, [], None

    def on_train_start(self, trainer, module) -> None:
        params = list(module.card.parameters_of(self.expert))
        optimizer = module.optimizer_of(self.expert)

        def record(_optimizer, _args, _kwargs):
            self.grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().float()
                                         for p in params]))
        self.handle = optimizer.register_step_pre_hook(record)

    def on_train_end(self, trainer, module) -> None:
        if self.handle is not None:
            self.handle.remove()


def measure(run: str, iterations: int, seed: int, overrides: list[str]) -> dict:
    config = run.split("@")[0]
    with tempfile.TemporaryDirectory() as root:
        zero = ["model.init_args.card.experts.transformer.optimizer.init_args.lr=0.0",
                "model.init_args.card.experts.transformer.grad_clip=1.0e+30", f"trainer.max_steps={iterations}",
                "trainer.limit_val_batches=0",
                f"seed_everything={seed}", f"data.init_args.seed={seed}", f"model.init_args.run.seed={seed}"]
        cli = build(config, root, zero + overrides)
        cli.trainer.callbacks = [c for c in cli.trainer.callbacks
                                 if type(c).__name__ not in ("SampleVideos", "Evaluate")]
        gradients = Gradients()
        cli.trainer.callbacks.append(gradients)
        cpu = time.process_time()
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        cpu = time.process_time() - cpu
        rollouts = cli.datamodule.batch_size * cli.model.grpo.num_samples_per_prompt
    if len(gradients.grads) < 3:
        raise SystemExit(f"{config}: {len(gradients.grads)} of {iterations} iterations stepped (a group whose samples "
                         f"all score alike has no advantage and makes no step): raise --iterations")
    gram = gram_of(torch.stack(gradients.grads))
    B, trace, signal = noise_scale(gram)
    return dict(config=run, steps=len(gram), iterations=iterations, rollouts=rollouts, B=B, trace=trace,
                signal=signal, cos=mean_cosine(gram), interval=interval(gram), cpu=cpu)


def fmt(x: float) -> str:
    return "∞" if math.isinf(x) else f"{x:.3g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["diffusion_nft", "flow_grpo"],
                        help="configs in configs/, each with an optional @label; the first is the baseline of the ratio")
    parser.add_argument("--iterations", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", nargs="*", default=[], help="overrides for every config, e.g. data.init_args.batch_size=2")
    parser.add_argument("--set-for", nargs="+", action="append", default=[], metavar=("CONFIG[@LABEL]", "KEY=VALUE"),
                        help="overrides for one run of --configs (repeatable)")
    args = parser.parse_args()
    own = {entry[0]: entry[1:] for entry in args.set_for}
    results = [measure(c, args.iterations, args.seed, args.set + own.get(c, [])) for c in args.configs]
    print("\n| config | steps measured | rollouts an iteration | noise scale B, iterations [±2 jackknife s.e. of |G|²] | "
          "B in rollouts | mean cosine of two iterations' gradients | tr Σ | |G|² | fit CPU-s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        lo, hi = r["interval"]
        print(f"| {r['config']} {' '.join(own.get(r['config'], []))} | {r['steps']} of {r['iterations']} | "
              f"{r['rollouts']} | {fmt(r['B'])} [{fmt(lo)}, {fmt(hi)}] | {fmt(r['B'] * r['rollouts'])} | "
              f"{r['cos']:.4f} | {r['trace']:.3g} | {r['signal']:.3g} | {r['cpu']:.0f} |")
    base = results[0]
    for r in results[1:]:
        ratio = (r["B"] * r["rollouts"]) / (base["B"] * base["rollouts"]) if math.isfinite(base["B"]) else math.nan
        print(f"{r['config']}: noise scale in rollouts {fmt(ratio)}× {base['config']}'s (same run, seed {args.seed})")


if __name__ == "__main__":
    main()
