"""AdamW's step on a Wan transformer's parameters: torch's default implementation vs ``fused=True``, interleaved.

The recipes under configs/recipes/ set ``fused: true`` on their AdamW (on a GPU the fused kernel is the fast path;
the per-tensor loop is slow by construction). This bench measures what that buys, on the device it runs on: the same
parameters, random gradients, ``--blocks`` candidate blocks of ``--per-block`` steps between baseline blocks
(``timing.py``). The baseline is what ``torch.optim.AdamW`` picks with neither ``foreach`` nor ``fused`` set — the
per-tensor loop on a CPU, ``foreach`` on a GPU. The two give equal updates up to float rounding (checked here on the
first step).

    python -m bench.optimizer                         # 2 blocks of Wan2.1-1.3B's width (119M parameters), CPU
    python -m bench.optimizer --layers 30 --device cuda   # the whole 1.3B transformer on a GPU
    python -m bench.optimizer --tiny                  # the tiny shape, seconds (tested)
"""
from __future__ import annotations

import argparse
import torch

from bench.gpu import TINY, WAN_1_3B
from bench.timing import compare, interleave
from posttrain.modules.models import presets


def optimizers(params: list[torch.nn.Parameter]) -> tuple[torch.optim.AdamW, torch.optim.AdamW]:
    settings = dict(lr=1e-5, weight_decay=0.01, betas=(0.9, 0.999))
    return torch.optim.AdamW(params, **settings), torch.optim.AdamW(params, fused=True, **settings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks of Wan2.1-1.3B's width")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape of bench/gpu.py --tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--per-block", type=int, default=3)
    args = parser.parse_args()

    shape = dict(TINY) if args.tiny else dict(WAN_1_3B, num_layers=args.layers)
    torch.manual_seed(0)
    model = presets.build_model("wan_t2v", preset=shape).to(args.device)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    count = sum(p.numel() for p in params)

    # one step of each from the same start: the updates agree up to rounding
    start = [p.detach().clone() for p in params]
    plain, fused = optimizers(params)
    plain.step()
    after_plain = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, s in zip(params, start):
            p.copy_(s)
    fused.step()
    worst = max((p.detach() - a).abs().max().item() for p, a in zip(params, after_plain))

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def step(optimizer):
        def run():
            optimizer.step()
            sync()
        return run

    blocks = interleave(step(plain), step(fused), args.blocks, args.per_block, names=("default", "fused"))
    print(f"AdamW step over {count / 1e6:.1f}M parameters on {args.device} ({torch.get_num_threads()} threads); "
          f"one step from the same start: largest difference {worst:.1e}")
    print(compare(blocks, per="step", ratio_name="fused/default").report())


if __name__ == "__main__":
    main()
