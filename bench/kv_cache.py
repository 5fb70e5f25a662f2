"""KV cache benchmark for the block-causal Wan student (Self-Forcing's chunk-by-chunk rollout).

Generating chunk k = denoising its latents over the few-step list, attending to chunks 1..k-1.
- cached:     each step is one forward of chunk k against the KV cache of chunks 1..k-1, plus one context pass
              at σ = 0 that stores chunk k (Self-Forcing ``pipeline/self_forcing_training.py``, step 3.3);
- recompute:  each step is one block-causal forward over chunks 1..k (clean earlier chunks at t = 0, chunk k at
              its σ), keeping chunk k's velocity; no cache.
Both give the same video (tests/test_causal_wan.py, 1e-5). The two are timed in alternating order inside
each block (cached first in even blocks, recompute first in odd ones), for k = 1..8; each reports the median
over blocks with the interquartile range (IQR). The ratio at k = 8 is printed only when the effect (difference
of the medians) exceeds the spread (sum of the two IQRs); otherwise the line says "too noisy".

    python -m bench.kv_cache                      # tiny wan_t2v preset, 16x16 latents, chunks of 3 frames
    python -m bench.kv_cache --blocks 21 --size 8 --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from diffusers import WanTransformer3DModel

from posttrain.modules.models.causal_wan import CausalWanTransformer3DModel
from posttrain.modules.models.presets import PRESETS

SIGMAS = [1.0, 0.75, 0.5, 0.25, 0.0]  # Self-Forcing's 4-step list (t = 1000, 750, 500, 250), Euler to 0


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


@torch.no_grad()
def generate_cached(model, cache, noise, cond) -> None:
    x = noise
    batch = noise.shape[0]
    for s, s_next in zip(SIGMAS[:-1], SIGMAS[1:]):
        v = model(x, torch.full((batch,), 1000 * s), cond, kv_cache=cache, return_dict=False)[0]
        x = x + (s_next - s) * v
    model(x, torch.zeros(batch), cond, kv_cache=cache, update_cache=True)


@torch.no_grad()
def generate_recomputed(model, context, noise, cond, chunk: int) -> None:
    x = noise
    batch, frames = noise.shape[0], context.shape[2]
    for s, s_next in zip(SIGMAS[:-1], SIGMAS[1:]):
        video = torch.cat([context, x], dim=2)
        t = torch.cat([torch.zeros(batch, frames), torch.full((batch, chunk), 1000 * s)], dim=1)
        v = model(video, t, cond, return_dict=False)[0][:, :, -chunk:]
        x = x + (s_next - s) * v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--chunk-frames", type=int, default=3, help="latent frames per chunk (Self-Forcing: 3)")
    parser.add_argument("--size", type=int, default=16, help="latent height = width")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=15, help="alternating timing blocks per k")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    teacher = WanTransformer3DModel(**PRESETS["wan_t2v"]).eval()
    model = CausalWanTransformer3DModel.from_bidirectional(teacher, num_frames_per_chunk=args.chunk_frames)
    n, b = args.chunk_frames, args.batch
    video = torch.randn(b, model.config.in_channels, args.chunks * n, args.size, args.size)
    cond = torch.randn(b, 16, model.config.text_dim)
    tokens = (args.size // 2) ** 2 * n
    print(f"[kv cache] tiny wan_t2v preset ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params), "
          f"batch {b}, chunks of {n} latent frames x {args.size}x{args.size} ({tokens} tokens), "
          f"{len(SIGMAS) - 1} steps, torch threads {args.threads}, {args.blocks} alternating blocks")

    # Cache of all finished chunks once; chunk k's run truncates it to k-1 chunks first.
    cache = model.new_cache()
    with torch.no_grad():
        model(video, torch.zeros(b), cond, kv_cache=cache, update_cache=True)
    full_cache = (list(cache.keys), list(cache.values), cache.num_frames, cache.tokens_per_frame)

    def run_cached(k: int) -> float:
        cache.keys, cache.values, cache.num_frames, cache.tokens_per_frame = (list(full_cache[0]),
                                                                               list(full_cache[1]), *full_cache[2:])
        cache.truncate((k - 1) * n)
        noise = video[:, :, (k - 1) * n:k * n]
        start = time.perf_counter()
        generate_cached(model, cache, noise, cond)
        return time.perf_counter() - start

    def run_recomputed(k: int) -> float:
        context, noise = video[:, :, :(k - 1) * n], video[:, :, (k - 1) * n:k * n]
        start = time.perf_counter()
        generate_recomputed(model, context, noise, cond, n)
        return time.perf_counter() - start

    ks = list(range(1, args.chunks + 1))
    run_cached(args.chunks), run_recomputed(args.chunks)  # warm-up
    cached = {k: [] for k in ks}
    recomputed = {k: [] for k in ks}
    for block in range(args.blocks):
        for k in ks:
            if block % 2 == 0:
                cached[k].append(run_cached(k))
                recomputed[k].append(run_recomputed(k))
            else:
                recomputed[k].append(run_recomputed(k))
                cached[k].append(run_cached(k))

    print(f"{'k':>3} {'cached ms (IQR)':>22} {'recompute ms (IQR)':>24} {'ratio':>7}")
    for k in ks:
        c1, c2, c3 = quartiles(cached[k])
        r1, r2, r3 = quartiles(recomputed[k])
        print(f"{k:>3} {c2 * 1e3:9.2f} ({c1 * 1e3:6.2f}-{c3 * 1e3:6.2f}) {r2 * 1e3:10.2f} ({r1 * 1e3:6.2f}-{r3 * 1e3:6.2f})"
              f" {r2 / c2:7.2f}")

    k = ks[-1]
    c1, c2, c3 = quartiles(cached[k])
    r1, r2, r3 = quartiles(recomputed[k])
    effect, spread = abs(r2 - c2), (c3 - c1) + (r3 - r1)
    f1, f2, f3 = quartiles(cached[1])
    if effect > spread:
        print(f"k={k}: recompute / cached = {r2 / c2:.2f} (medians {r2 * 1e3:.2f} vs {c2 * 1e3:.2f} ms; "
              f"effect {effect * 1e3:.2f} ms > spread {spread * 1e3:.2f} ms)")
    else:
        print(f"k={k}: too noisy (effect {effect * 1e3:.2f} ms <= spread {spread * 1e3:.2f} ms)")
    print(f"cached cost k={k} vs k=1: {c2 / f2:.2f}x (a flat cache would be 1.00; attention over the cache grows "
          f"with k)")


if __name__ == "__main__":
    main()
