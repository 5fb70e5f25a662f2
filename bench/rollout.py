"""Rollout benchmarks for the RL methods (CPU by default).

1. A K-sample group rolled out as ONE batched forward per sampler step (what flow_grpo and joint_rl
   do: ``modules.rollout.rollout`` on B·K rows) vs K sequential rollouts of one row each, same
   process, same weights, same SDE sampler; prints both times and their ratio.
2. The prompt-embedding cache hit rate over a short joint_rl run built from ``configs/joint_rl.yaml``
   (no logger, no checkpoints): the frozen text encoder's cache is keyed by (component, version,
   prompt hash), so generator and refiner updates never flush it.

    python bench/rollout.py                    # K = 4, 8, 16, 9x32x32 video, 6 steps; 60 joint_rl iterations
    python bench/rollout.py --iterations 120 --group-sizes 4 8 16 --repeats 9
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from lightning.pytorch import Callback, Trainer, seed_everything

from posttrain.modules import vae as vae_codec
from posttrain.modules.cards import Expert, ModelCard
from posttrain.modules.rollout import rollout
from posttrain.modules.samplers import FlowMatchSampler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "a red circle moving left on a blue background"


def bench_group(group_sizes: list[int], repeats: int, frames: int, size: int, steps: int) -> None:
    seed_everything(0)
    card = ModelCard(experts={"text_encoder": Expert(arch="umt5"), "vae": Expert(arch="wan_vae"),
                              "transformer": Expert(arch="wan_t2v")})
    card.build()
    sampler = FlowMatchSampler(num_steps=steps)
    shape = vae_codec.latent_shape(card["vae"], frames, size, size)
    print(f"[group rollout] Wan tiny preset, video {frames}x{size}x{size} -> latents {shape}, {steps} SDE steps, "
          f"torch threads {torch.get_num_threads()}, median of {repeats}")
    for K in group_sizes:
        cond = card.prompt_embeds([PROMPT] * K)
        rollout(sampler, card["transformer"], cond, shape, torch.Generator().manual_seed(0))  # warm-up
        batched, sequential = [], []
        for r in range(repeats):
            g = torch.Generator().manual_seed(r)
            t = time.perf_counter()
            rollout(sampler, card["transformer"], cond, shape, g)
            batched.append(time.perf_counter() - t)
            g = torch.Generator().manual_seed(r)
            t = time.perf_counter()
            for k in range(K):
                rollout(sampler, card["transformer"], cond[k:k + 1], shape, g)
            sequential.append(time.perf_counter() - t)
        b, s = statistics.median(batched), statistics.median(sequential)
        print(f"  K={K:3d}: batched {b * 1e3:8.1f} ms ({steps} forwards of {K} rows)   "
              f"sequential {s * 1e3:8.1f} ms ({K * steps} forwards of 1 row)   speed-up x{s / b:.2f}")


class CacheCounts(Callback):
    """Cumulative (hits, misses) of the card's prompt-embedding cache after every iteration."""

    def __init__(self):
        self.rows: list[tuple[int, int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append((pl_module.card.cache.hits, pl_module.card.cache.misses))


def bench_cache(iterations: int) -> None:
    from posttrain.lit.cli import PosttrainCLI

    cli = PosttrainCLI(args=["--config", os.path.join(ROOT, "configs", "joint_rl.yaml"), "--trainer.logger=false"],
                       run=False)
    model, data = cli.model, cli.datamodule
    counts = CacheCounts()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=iterations, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0, callbacks=[counts])
    t = time.perf_counter()
    trainer.fit(model, data)
    elapsed = time.perf_counter() - t
    cache = model.card.cache
    K, S = model.num_samples_per_prompt, model.num_skip_refinement
    print(f"[cache] configs/joint_rl.yaml, N={model.card.num_refiners} refiners, K={K} "
          f"(num_skip_refinement={S}), batch {data.batch_size} prompts, {iterations} iterations in {elapsed:.1f} s "
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
    print(f"  versions: " + ", ".join(f"{n}={v}" for n, v in model.card.versions.items() if "reference" not in n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--iterations", type=int, default=60, help="joint_rl iterations for the cache figure")
    args = parser.parse_args()
    with torch.no_grad():
        bench_group(args.group_sizes, args.repeats, args.frames, args.size, args.steps)
    bench_cache(args.iterations)


if __name__ == "__main__":
    main()
