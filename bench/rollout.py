"""Rollout benchmarks for the RL methods (CPU by default).

1. A K-sample group rolled out as ONE batched forward per sampler step (what flow_grpo and joint_rl
   do: ``modules.rollout.Rollout.sample`` on B·K rows) vs K sequential rollouts of one row each, same
   process, same weights, same SDE sampler. The two alternate in blocks (``timing.py``); prints the
   speed-up sequential/batched with its spread and a verdict (goal at K = 8: >= 6), and where the batched
   rollout's time goes: the transformer forward of K rows, and everything else per step (SDE step,
   log-probability, noise, capture), the forward's own speed-up (one forward of K rows against K
   forwards of one row, also interleaved), and the bound the rollout would reach if all but the
   forward were free.
2. The prompt-embedding cache hit rate over a short joint_rl run built from the keyword game
   ``tests/configs/joint_rl_keywords.yaml`` (random refiners, fast to roll out; no logger, no checkpoints): the
   frozen text encoder's cache is keyed by (component, version, prompt hash), so generator and refiner updates
   never flush it. Counts are deterministic.

    OMP_NUM_THREADS=1 python -m bench.rollout     # K = 4, 8, 16, 9x32x32 video, 6 steps; 60 joint_rl iterations
    python -m bench.rollout --group-sizes 8 --blocks 11 --iterations 0
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from lightning.pytorch import Callback, Trainer, seed_everything

from bench.timing import compare, interleave
from posttrain.modules.models.cards import Expert, ModelCard
from posttrain.modules.models.generators import GeneratorStage, VideoSize
from posttrain.modules.rl.rollout import Rollout
from posttrain.modules.flow.samplers import FlowMatchSampler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "a red circle moving left on a blue background"
GOAL_K8 = 6.0


class ForwardTimer:
    """Sums the process time of a module's forwards (hooks), to split a rollout into forward and the rest."""

    def __init__(self, module: torch.nn.Module):
        self.seconds, self._start = 0.0, 0.0
        module.register_forward_pre_hook(lambda *_: setattr(self, "_start", time.process_time()))
        module.register_forward_hook(lambda *_: setattr(self, "seconds", self.seconds + time.process_time()
                                                        - self._start))


def bench_group(group_sizes: list[int], blocks: int, frames: int, size: int, steps: int) -> None:
    seed_everything(0)
    card = ModelCard(experts={"text_encoder": Expert(arch="umt5"), "vae": Expert(arch="wan_vae"),
                              "transformer": Expert(arch="wan_t2v")})
    card.build()
    stage = GeneratorStage(card)
    sampler = FlowMatchSampler(num_steps=steps)
    shape = stage.latent_shape(VideoSize(frames, size, size))
    timer = ForwardTimer(card["transformer"])
    print(f"[group rollout] Wan tiny preset, video {frames}x{size}x{size} -> latents {shape}, {steps} SDE steps, "
          f"torch threads {torch.get_num_threads()}; {blocks} sequential blocks between {blocks + 1} batched blocks")
    for K in group_sizes:
        cond = stage.condition([PROMPT] * K)
        seeds = iter(range(10**6))

        def batched():
            Rollout.sample(stage, sampler, cond, None, shape, torch.Generator().manual_seed(next(seeds)))

        def sequential():
            g = torch.Generator().manual_seed(next(seeds))
            for k in range(K):
                Rollout.sample(stage, sampler, cond.select(slice(k, k + 1)), None, shape, g)

        result = interleave(batched, sequential, blocks=blocks, per_block=1, names=("batched", "sequential"))
        c = compare(result, goal=GOAL_K8 if K == 8 else None, higher_is_better=True, per="group",
                    ratio_name=f"speed-up K={K} (sequential/batched)")
        print(f"  K={K}: one group = {steps} forwards of {K} rows (batched) or {K * steps} forwards of 1 row")
        print(c.report())

        # where a batched rollout's time goes: the forward of K rows, and the rest of each step
        timer.seconds = 0.0
        start = time.process_time()
        for _ in range(blocks):
            batched()
        total = time.process_time() - start
        forward = timer.seconds
        x = torch.randn((K, *shape))
        t = sampler.timestep_of(torch.full((K,), 0.5))
        with torch.no_grad(), stage.velocity() as fn:
            forwards = interleave(lambda: fn(x, t, cond),
                                  lambda: [fn(x[k:k + 1], t[k:k + 1], cond.select(slice(k, k + 1))) for k in range(K)],
                                  blocks=blocks, per_block=steps,
                                  names=(f"forward of {K} rows", f"{K} forwards of 1 row"))
        f = compare(forwards, higher_is_better=True, per="forward",
                    ratio_name=f"forward speed-up K={K} (K x 1 row / K rows)")
        per_step = (total - forward) / (blocks * steps)
        print(f"  batched rollout, per step (process time): forward of {K} rows {forward / (blocks * steps) * 1e3:.2f} ms, "
              f"everything else {per_step * 1e3:.2f} ms ({(total - forward) / total:.0%} of the rollout)")
        print("  " + f.verdict("cpu"))
        sequential_cpu = statistics.median(x.cpu for x in result.samples["sequential"])
        print(f"  bound: with everything but the forward free in the batched rollout, the speed-up would be "
              f"x{sequential_cpu / (forward / blocks):.2f} (sequential {sequential_cpu * 1e3:.1f} ms / "
              f"{steps} forwards of {K} rows {forward / blocks * 1e3:.1f} ms, CPU)")


CACHE_CONFIG = "tests/configs/joint_rl_keywords.yaml"  # the cache figure's run


class CacheCounts(Callback):
    """Cumulative (hits, misses) of the card's prompt-embedding cache after every iteration."""

    def __init__(self):
        self.rows: list[tuple[int, int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append((pl_module.card.cache.hits, pl_module.card.cache.misses))


def bench_cache(iterations: int) -> None:
    from posttrain.lit.tools.config import PosttrainCLI

    cli = PosttrainCLI(args=["--config", os.path.join(ROOT, CACHE_CONFIG), "--trainer.logger=false"], run=False)
    model, data = cli.model, cli.datamodule
    counts = CacheCounts()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=iterations, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0, callbacks=[counts])
    t = time.perf_counter()
    trainer.fit(model, data)
    elapsed = time.perf_counter() - t
    cache = model.card.cache
    K, S = model.grpo.num_samples_per_prompt, model.refiner_args.num_unrefined
    print(f"[cache] {CACHE_CONFIG}, N={model.card.num_refiners} refiners, K={K} "
          f"(refiners.num_unrefined={S}), batch {data.batch_size} prompts, {iterations} iterations in {elapsed:.1f} s "
          f"({elapsed / iterations:.2f} s/iteration)")
    print(f"  text_encoder lookups {cache.hits + cache.misses}: hits {cache.hits}, misses (encoded) {cache.misses}, "
          f"hit rate {cache.hit_rate:.3f}; prompts cached {len(cache.keys_of('text_encoder'))}, all at "
          f"text_encoder version {model.card.versions['text_encoder']}")
    window = max(1, iterations // 4)
    for start in range(0, iterations, window):
        end = min(start + window, iterations)
        h0, m0 = counts.rows[start - 1] if start else (0, 0)
        h1, m1 = counts.rows[end - 1]
        print(f"  iterations {start + 1:3d}-{end:3d}: hit rate {(h1 - h0) / max(h1 - h0 + m1 - m0, 1):.3f} "
              f"({h1 - h0} hits, {m1 - m0} misses)")
    print("  versions: " + ", ".join(f"{n}={v}" for n, v in model.card.versions.items() if "reference" not in n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--blocks", type=int, default=7, help="sequential blocks (batched: one more)")
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--iterations", type=int, default=60, help="joint_rl iterations for the cache figure")
    args = parser.parse_args()
    with torch.no_grad():
        bench_group(args.group_sizes, args.blocks, args.frames, args.size, args.steps)
    if args.iterations > 0:
        bench_cache(args.iterations)


if __name__ == "__main__":
    main()
