"""Filling a folder's latents cache: one process encoding every clip against two processes encoding a share each.

``VideoFolder.fill_cache`` gives process ``r`` of ``P`` every P-th missing entry, as the ranks of a run do before
training (each entry written atomically, so processes never see half a file). A folder of ``--clips`` generated
mp4 clips (``--frames`` × ``--size``², the world's moving shapes) is encoded by the shipped Wan VAE into a fresh
cache: the baseline by one process alone, the candidate by two processes at once (forked; one intra-op thread each,
as each rank would own its device), in alternating blocks (bench/timing.py). Reported: seconds per fill, and the
ratio two processes / one by the wall clock (the CPU clock counts this process alone, not the forked
ones: read the wall ratio). On this 2-core machine two processes is the most that can run side by side; each rank
of a real run brings its own GPU, so the ratio there is about 1/P where decoding the files does not dominate.

    OMP_NUM_THREADS=1 python -m bench.cache_fill                  # 24 clips of 17 × 64 × 64
    OMP_NUM_THREADS=1 python -m bench.cache_fill --clips 48 --blocks 7
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import tempfile

import torch

from bench.timing import compare, interleave
from posttrain.datamodules.folder import VideoFolder
from posttrain.modules.io.media import write_media
from posttrain.modules.models.cards import Expert, ModelCard
from posttrain.modules.world.world import render

COLOURS = ("red", "green", "blue", "yellow", "cyan")
SHAPES = ("circle", "square", "triangle")


def make_folder(root: str, clips: int, frames: int, size: int) -> None:
    """``clips`` captioned mp4s of moving shapes under ``root``, no two alike."""
    os.makedirs(root, exist_ok=True)
    for i in range(clips):
        colour, shape = COLOURS[i % len(COLOURS)], SHAPES[i % len(SHAPES)]
        path = os.path.join(root, f"clip_{i:03d}.mp4")
        start = (0.3 + 0.4 * i / clips, 0.5)  # every clip its own bytes: the cache keys a file by its content
        write_media(path, render(shape, colour, "right", "magenta", frames, size, size, start=start))
        with open(os.path.splitext(path)[0] + ".txt", "w") as f:
            f.write(f"a {colour} {shape} moving right")


def fill(root: str, cache: str, frames: int, size: int, vae, rank: int, processes: int) -> None:
    torch.set_num_threads(1)
    data = VideoFolder(root, frames=frames, height=size, width=size, latents_cache=cache)
    data.fill_cache(vae, rank=rank, processes=processes, record=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=24)
    parser.add_argument("--frames", type=int, default=17, help="4k + 1 for the Wan VAE")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=5)
    args = parser.parse_args()
    card = ModelCard({"vae": Expert(arch="wan_vae")})
    card.build()
    vae = card.models["vae"].eval()
    work = tempfile.mkdtemp(prefix="cache_fill_")
    root = os.path.join(work, "clips")
    make_folder(root, args.clips, args.frames, args.size)
    context = multiprocessing.get_context("fork")
    fills = iter(range(10**6))

    def one() -> None:
        cache = os.path.join(work, f"cache_{next(fills)}")
        fill(root, cache, args.frames, args.size, vae, 0, 1)
        assert sum(n.endswith(".safetensors") for n in os.listdir(cache)) == args.clips
        shutil.rmtree(cache)

    def two() -> None:
        cache = os.path.join(work, f"cache_{next(fills)}")
        procs = [context.Process(target=fill, args=(root, cache, args.frames, args.size, vae, r, 2)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            assert p.exitcode == 0, p.exitcode
        assert sum(n.endswith(".safetensors") for n in os.listdir(cache)) == args.clips  # every entry, written once by one of the two
        shutil.rmtree(cache)

    try:
        with torch.no_grad():
            timed = interleave(one, two, blocks=args.blocks, per_block=1, names=("one process", "two processes"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"latents cache of {args.clips} clips of {args.frames} x {args.size} x {args.size} (shipped wan_vae, one "
          f"intra-op thread a process)")
    print(compare(timed, unit="s", per="fill", ratio_name="two processes / one").report())


if __name__ == "__main__":
    main()
