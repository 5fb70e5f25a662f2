"""Per-process activation memory and step time of one Wan generator step at sequence parallelism 1 and 2.

Two processes over gloo hold the same Wan transformer twice: ``whole``, with which each process runs the whole
sample alone (sequence parallelism 1: what a process of plain data parallelism holds), and ``shared``, under
diffusers' Ulysses context parallelism over both processes (``modules/models/sequence_parallel.py``, the code
``ShardedExpertsStrategy(sequence_parallel: 2)`` runs: each process holds half of the sample's tokens, half of the
heads inside attention). Both run one generator step (forward, then backward of a squared-output loss) on the same
video and text; the inputs are the shapes ``posttrain estimate`` traces for a finetune config of this transformer
and video size (written to a temporary folder), so the estimate's prediction stands beside the measurement.

Memory, per process and side, two measurements:

- **saved for backward**: the bytes of the distinct non-parameter storages autograd saves in the forward
  (``torch.autograd.graph.saved_tensors_hooks``): what stays alive from the forward until backward frees it, the
  figure ``posttrain estimate`` predicts as "activations";
- **peak**: the maximum over forward and backward of the bytes allocated since the step began, summed from the
  allocator's own allocation and free events (``torch.profiler.profile(profile_memory=True)``), the gradients
  existing already (backward adds into them): the saved activations plus every temporary (attention's working
  memory, the all-to-all buffers, backward's intermediates). (The profiler's categorised timeline,
  ``export_memory_timeline``, is deprecated and its data-flow check fails on the all-to-all's outputs.)

Why these: the CPU allocator keeps no peak statistic (``torch.cuda.max_memory_allocated`` has no CPU twin), and the
garbage-collector walk of ``bench/memory.py`` cannot see autograd's saved tensors (they are not Python objects).
Gradient reduction is left out of both sides: data parallelism all-reduces the same gradients with or without
sequence groups.

Step time: blocks of ``whole`` and ``shared`` steps alternate in the same process pair (``timing.py``; rank 0's
clock, a ``shared`` step ends in the all-to-all, so it includes waiting for rank 1); the ratio with its spread.

    python -m bench.sequence_parallel              # 2 processes, CPU (from the repository root)
    python -m bench.sequence_parallel --tiny       # a seconds-long smoke run
"""
from __future__ import annotations

import argparse
import copy
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from bench.timing import compare, interleave

def write_config(folder: str, args) -> str:
    """A finetune config of this transformer and video size (tiny text encoder and VAE)."""
    transformer = {"arch": "wan_t2v", "trainable": True,
                   "preset": {"num_layers": args.layers, "num_attention_heads": args.heads,
                              "attention_head_dim": args.head_dim, "ffn_dim": 4 * args.heads * args.head_dim},
                   "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-4}}}
    cfg = {"trainer": {"accelerator": "cpu", "devices": 2, "logger": False,
                       "strategy": {"class_path": "posttrain.lit.engine.strategy.ShardedExpertsStrategy",
                                    "init_args": {"sequence_parallel": 2}}},
           "model": {"class_path": "posttrain.lit.finetune.Finetune",
                     "init_args": {"card": {"experts": {"text_encoder": {"arch": "umt5"}, "vae": {"arch": "wan_vae"},
                                                        "transformer": transformer},
                                            "text_max_length": args.text_length},
                                   "run": {"frames": args.frames, "height": args.height, "width": args.width}}},
           "data": {"class_path": "posttrain.datamodules.synthetic.SyntheticVideos", "init_args": {"batch_size": 1}}}
    path = os.path.join(folder, "sequence_parallel.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def predicted(path: str) -> tuple[dict, dict[int, int]]:
    """The training forward's input shapes, and ``posttrain estimate``'s activations of the transformer at
    sequence parallelism 1 and 2."""
    from posttrain.lit.tools.config import instantiate_part, parse
    from posttrain.lit.tools.estimate import estimate, input_shapes, meta_model

    method = instantiate_part(parse(path), "model", path, "estimate")
    for name, spec in method.card.specs.items():
        method.card.models[name] = meta_model(spec)
    config = dict(method.card.models["transformer"].config)
    shapes = input_shapes("wan_t2v", config, method.card, method, rows=1)
    return shapes, {k: estimate(path, sequence_parallel=k)["transformer"].activation_bytes for k in (1, 2)}


def step(model, inputs) -> None:
    out = model(**inputs)[0]
    (out.float() ** 2).mean().backward()


def saved_bytes(model, inputs) -> int:
    """Bytes of the distinct non-parameter storages the forward saves for backward (then backward runs)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**inputs)[0]
    (out.float() ** 2).mean().backward()
    return sum(saved.values())


def peak_bytes(model, inputs) -> int:
    """Peak, over one step, of the bytes allocated since it began, from the allocator's own events as torch's
    profiler records them (``profile_memory``: every allocation and free with its size and time). The gradients
    exist before the step (a first step made them; backward adds into them in place), so what the peak holds is
    activations and temporaries."""
    from torch.profiler import ProfilerActivity, profile

    step(model, inputs)  # the gradients' storage, kept
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(model, inputs)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, change in events:
        live += change
        peak = max(peak, live)
    return peak


def worker(rank: int, args, shapes: dict, out) -> None:
    from posttrain.lit.tools.estimate import _inputs
    from posttrain.modules.models import presets
    from posttrain.modules.models.sequence_parallel import enable_sequence_parallel, sequence_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    whole = presets.build_model("wan_t2v", preset={"num_layers": args.layers, "num_attention_heads": args.heads,
                                                   "attention_head_dim": args.head_dim,
                                                   "ffn_dim": 4 * args.heads * args.head_dim}).train()
    shared = copy.deepcopy(whole)
    enable_sequence_parallel(shared, sequence_mesh(2))
    torch.manual_seed(1)  # the same sample on both processes: they share it
    inputs = _inputs(shapes, torch.float32)
    figures = {}
    for name, model in (("whole", whole), ("shared", shared)):
        figures[name] = {"saved": saved_bytes(model, inputs), "peak": peak_bytes(model, inputs)}
        model.zero_grad(set_to_none=True)
    blocks = interleave(lambda: step(whole, inputs), lambda: step(shared, inputs), blocks=args.blocks,
                        per_block=args.steps, names=("SP=1", "SP=2"), warmup=1)
    gathered = [None, None]
    dist.all_gather_object(gathered, figures)
    if rank == 0:
        out.put((gathered, blocks))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--frames", type=int, default=17, help="pixel frames (latent: (F-1)/4+1)")
    parser.add_argument("--height", type=int, default=256)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--text_length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2, help="steps per timing block")
    parser.add_argument("--blocks", type=int, default=5, help="SP=2 timing blocks (SP=1: one more)")
    parser.add_argument("--tiny", action="store_true", help="a seconds-long run: 1 layer, 2 heads, a 9x64x64 video")
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.heads, args.head_dim, args.frames, args.height, args.width = 1, 2, 32, 9, 64, 64
        args.steps, args.blocks = 1, 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        args.port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        args.folder = folder
        shapes, estimate = predicted(write_config(folder, args))
        out = mp.get_context("spawn").SimpleQueue()
        mp.spawn(worker, args=(args, shapes, out), nprocs=2, join=True)
        figures, blocks = out.get()
    _, _, f, h, w = shapes["hidden_states"]
    tokens = f * (h // 2) * (w // 2)
    mib = 2**20
    print(f"Wan transformer: layers={args.layers} heads={args.heads} head_dim={args.head_dim}; video "
          f"{args.frames}x{args.height}x{args.width} -> latents {f}x{h}x{w}, {tokens} tokens, text {args.text_length}; "
          f"one step (forward + backward), 2 processes, gloo")
    for rank, side in enumerate(figures):
        print(f"rank {rank}: saved for backward  SP=1 {side['whole']['saved'] / mib:8.2f} MiB   "
              f"SP=2 {side['shared']['saved'] / mib:8.2f} MiB   |   peak (profiler)  "
              f"SP=1 {side['whole']['peak'] / mib:8.2f} MiB   SP=2 {side['shared']['peak'] / mib:8.2f} MiB")
    ratios = {kind: max(side["shared"][kind] for side in figures) / max(side["whole"][kind] for side in figures)
              for kind in ("saved", "peak")}
    print(f"memory ratio SP=2 / SP=1 (max over ranks): saved for backward {ratios['saved']:.3f}, "
          f"peak {ratios['peak']:.3f}  (goal <= 0.55, ideal 0.5)")
    print(f"posttrain estimate: activations SP=1 {estimate[1] / mib:.2f} MiB, SP=2 {estimate[2] / mib:.2f} MiB, "
          f"ratio {estimate[2] / estimate[1]:.3f}")
    print(f"step time, {args.blocks} SP=2 blocks between {args.blocks + 1} SP=1 blocks of {args.steps} steps (rank 0):")
    print(compare(blocks, per="step", ratio_name="step time SP=2/SP=1").report())


if __name__ == "__main__":
    main()
