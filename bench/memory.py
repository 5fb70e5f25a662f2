"""Per-process memory of the generator's parameters + gradients + optimizer state, ZeRO-3 vs DDP.

Two process pairs over gloo train the same Wan transformer (a larger CPU-friendly preset) with AdamW
for a few steps: one under plain DDP, one in a ZeRO-3 engine built under ``deepspeed.zero.Init`` with
the DeepSpeed config ``lit.engine.strategy`` gives an expert with ``sharded: true, zero: {stage: 3}``.
Memory is the peak, over sample points inside every transformer block's forward and after backward
and step (of the second step; the first creates the optimizer state), of the bytes of all distinct
tensor storages alive in the process (found through the garbage collector plus every parameter's
``.grad``) minus the bytes alive before the model was built: weights (full or partitions, plus
gathered ones), gradients (DDP buckets are the ``.grad`` views with ``gradient_as_bucket_view=True``;
ZeRO's partition buffers) and optimizer state. Activations held by autograd are not Python objects
and are not counted (inputs are tiny anyway).

Step times come from a third process pair that holds both models and alternates blocks of DDP steps and
ZeRO-3 steps (``timing.py``): the ratio is reported with its spread, or "too noisy". Memory figures come
from the first two pairs, where each mode is alone in its processes.

    python -m bench.memory                       # 2 processes, CPU (from the repository root)
    python -m bench.memory --precision bf16      # ZeRO-3 in bf16 (fp32 master weights), DDP fp32
    python -m bench.memory --layers 4 --steps 2  # quicker

On the CPU DeepSpeed keeps the fp32 master partition as a copy of the fp32 weight partition (it compares
a ``torch.device`` with a device name), so fp32 ZeRO-3 holds 5 partitions of the model (weights, gradients,
master, 2 Adam moments) against DDP's 4 full copies: 5/(4N) of DDP at N processes before buckets,
0.63 at N = 2. In bf16 ZeRO-3 holds 2+2+4+4+4 = 16/N bytes per parameter against DDP's 16.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.timing import compare, interleave


def live_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on some library objects warns
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    for t in tensors:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if storage.data_ptr() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


class Peak:
    """Max of ``live_bytes`` over sample points (every block's forward, after backward and step);
    sampling is on only in the measured step, off in the timed ones."""

    def __init__(self, model: torch.nn.Module, blocks: torch.nn.ModuleList, base: int):
        self.model, self.base, self.peak, self.on = model, base, 0, False
        for block in blocks:
            block.register_forward_hook(lambda *_: self.sample())

    def sample(self) -> None:
        if self.on:
            self.peak = max(self.peak, live_bytes(self.model) - self.base)


def preset(layers: int, heads: int, head_dim: int) -> dict:
    return dict(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim, in_channels=16,
                out_channels=16, text_dim=32, freq_dim=64, ffn_dim=4 * heads * head_dim, num_layers=layers,
                qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def batch(model, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = next(model.parameters()).dtype
    x = torch.randn(1, 16, 2, 8, 8, generator=g).to(dtype)
    cond = torch.randn(1, 16, 32, generator=g).to(dtype)
    return x, cond


def one_step(model, step_fn, g: torch.Generator, peak: "Peak") -> None:
    x, cond = batch(model, g)
    out = model(hidden_states=x, timestep=torch.tensor([500.0]), encoder_hidden_states=cond, return_dict=False)[0]
    step_fn(out.float().pow(2).mean(), peak)


def train(model, step_fn, peak: Peak) -> None:
    """A warm-up step (it creates the optimizer state), then the measured step."""
    g = torch.Generator().manual_seed(dist.get_rank())
    for i in range(2):
        peak.on = i == 1
        dist.barrier()
        one_step(model, step_fn, g, peak)
        peak.sample()
    peak.on = False


def build(mode: str, args, precision: str):
    """(wrapped model, model, step function) of ``ddp`` (full fp32 weights, gradients and AdamW state on every
    process) or ``zero3`` (built partitioned: 1/2 of each per process)."""
    import deepspeed
    from diffusers import WanTransformer3DModel

    from posttrain.lit.engine.strategy import deepspeed_config  # the configuration the strategy gives a sharded expert
    from posttrain.modules.models.cards import Expert, ZeroConfig

    config = preset(args.layers, args.heads, args.head_dim)
    torch.manual_seed(0)
    if mode == "ddp":
        model = WanTransformer3DModel(**config)
        wrapped = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(loss, peak):
            loss.backward()
            peak.sample()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)  # keep the buckets, as a training loop does

        return wrapped, model, step
    spec = Expert(arch="wan_t2v", trainable=True, optimizer=torch.optim.AdamW, sharded=True, grad_clip=None,
                  zero=ZeroConfig(stage=3, precision=precision))
    with deepspeed.zero.Init(config_dict_or_path=deepspeed_config(spec)):
        model = WanTransformer3DModel(**config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    wrapped, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(spec, model))

    def step(loss, peak):
        wrapped.backward(loss)
        peak.sample()
        wrapped.step()

    return wrapped, model, step


def setup_process(rank: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, dist_init_required=False,
                               verbose=False)


def worker(rank: int, args, mode: str, out) -> None:
    """One process of one memory phase (``ddp`` or ``zero3``); a fresh process pair per phase, so that nothing
    of one phase is alive in the other's measurement."""
    setup_process(rank, args)
    gc.collect()
    base = live_bytes(torch.nn.Linear(1, 1))
    wrapped, model, step = build(mode, args, args.precision)
    peak = Peak(model, model.blocks, base)
    train(wrapped, step, peak)
    peaks = [torch.zeros(1, dtype=torch.float64) for _ in range(2)]
    dist.all_gather(peaks, torch.tensor([float(peak.peak)], dtype=torch.float64))
    if rank == 0:
        out.put({"peaks": [p.item() for p in peaks],
                 "params": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())})
    leave()


def leave() -> None:
    """End a worker once both ranks are past their last collective, without the interpreter's teardown:
    on a fresh CI machine a spawned ZeRO-3 process once aborted while exiting ("terminate called without
    an active exception": a C++ thread of the process group destroyed still joinable), after its results
    were already sent. ``SimpleQueue.put`` writes synchronously, so nothing is lost by leaving at once."""
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def timing_worker(rank: int, args, out) -> None:
    """Both models in one process pair; blocks of DDP steps and ZeRO-3 steps alternate (rank 0's clock: every
    step ends in collectives, so it includes waiting for rank 1)."""
    setup_process(rank, args)
    sides = {}
    for mode in ("ddp", "zero3"):
        wrapped, model, step = build(mode, args, args.precision)
        peak = Peak(model, [], 0)
        g = torch.Generator().manual_seed(rank)
        sides[mode] = lambda w=wrapped, s=step, p=peak, g=g: one_step(w, s, g, p)
    blocks = interleave(sides["ddp"], sides["zero3"], blocks=args.blocks, per_block=args.steps,
                        names=("DDP fp32", f"ZeRO-3 {args.precision}"), warmup=2)
    if rank == 0:
        out.put(blocks)
    leave()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="steps per timing block")
    parser.add_argument("--blocks", type=int, default=7, help="ZeRO-3 timing blocks (DDP: one more)")
    parser.add_argument("--port", type=int, default=29517)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="ZeRO-3 weights and gradients; DDP stays fp32 (what bf16-mixed DDP holds too)")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = {}
    for mode in ("ddp", "zero3"):
        out = ctx.SimpleQueue()
        mp.spawn(worker, args=(args, mode, out), nprocs=2, join=True)
        results[mode] = out.get()
    out = ctx.SimpleQueue()
    mp.spawn(timing_worker, args=(args, out), nprocs=2, join=True)
    blocks = out.get()
    mib, n = 2**20, results["ddp"]["params"]
    print(f"Wan transformer preset: layers={args.layers} heads={args.heads} head_dim={args.head_dim} "
          f"({n / 1e6:.1f}M parameters, {4 * n / mib:.0f} MiB fp32); 2 processes, gloo, AdamW; "
          f"DDP fp32, ZeRO-3 {args.precision}")
    for rank in range(2):
        print(f"rank {rank}: peak params+grads+optimizer state  DDP {results['ddp']['peaks'][rank] / mib:8.1f} MiB"
              f"   ZeRO-3 {results['zero3']['peaks'][rank] / mib:8.1f} MiB")
    ratio = max(results["zero3"]["peaks"]) / max(results["ddp"]["peaks"])
    print(f"memory ratio ZeRO-3 / DDP (max over ranks): {ratio:.3f}  (goal <= 0.6)")
    print(f"step time, {args.blocks} ZeRO-3 blocks between {args.blocks + 1} DDP blocks of {args.steps} steps (rank 0):")
    print(compare(blocks, per="step", ratio_name="step time ZeRO-3/DDP").report())


if __name__ == "__main__":
    main()
