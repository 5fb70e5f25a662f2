"""``torch.compile`` as an expert option (``compile: true``): the speed-up of one finetune training step.

The same Wan transformer (the world's ``wan_t2v`` preset cut to 2 layers, random weights) is stepped eagerly and
compiled (``nn.Module.compile``: what the expert option does), with
the same data, loss and AdamW, in alternating blocks (bench/timing.py). Compilation happens in the warm-up
and is not timed; its one-off cost is printed.

    python -m bench.compile                 # CPU, default preset
    python -m bench.compile --device cuda   # on a GPU (bf16 autocast)
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

from bench.timing import compare, interleave
from posttrain.modules.models import presets
from posttrain.modules.flow.losses import flow_matching_loss, noised, sample_sigmas


def stepper(model: torch.nn.Module, batch: int, device: str):
    """One flow-matching training step of ``model`` on fixed random latents and text (forward, backward, AdamW)."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(batch, 16, 2, 8, 8, generator=g).to(device)
    text = torch.randn(batch, 16, model.config.text_dim, generator=g).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        sigma = sample_sigmas(batch, "logit_normal", g).to(device)
        noise = torch.randn(x0.shape, generator=g).to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            v = model(noised(x0, noise, sigma), timestep=sigma * 1000, encoder_hidden_states=text,
                      return_dict=False)[0]
        per_sample, _ = flow_matching_loss(v.float(), x0, noise)
        per_sample.mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--per-block", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    eager = presets.build_model("wan_t2v", preset={"num_layers": 2}).to(args.device).train()
    compiled = copy.deepcopy(eager)
    compiled.compile()
    eager_step, compiled_step = stepper(eager, args.batch, args.device), stepper(compiled, args.batch, args.device)
    start = time.time()
    compiled_step()  # compiles forward and backward
    print(f"compilation (first step): {time.time() - start:.1f} s")
    blocks = interleave(eager_step, compiled_step, args.blocks, args.per_block, names=("eager", "compiled"))
    print(f"{sum(p.numel() for p in eager.parameters()) / 1e6:.2f}M-parameter Wan transformer, batch {args.batch}, "
          f"{args.device}")
    print(compare(blocks, higher_is_better=False, ratio_name="compiled / eager step time").report())


if __name__ == "__main__":
    main()
