"""What a user sees after request RL: a before/after sheet of one ``experiments/rl_compare.py`` run.

The run's config is built as ``rl_compare.py`` builds it (seed and all), its system serves the evaluation's
held-out requests (``rl_compare.EvalSet``: 64 requests in the training wording, noise of batch ``i`` from
``NOISE_SEED + i``) before training and again with the weights of the run's checkpoint (read as ``posttrain
predict`` reads one: the verified loader, ``modules.checkpoints.load``, then the module's ``on_load_checkpoint``,
which refuses another card's checkpoint and puts back the frozen experts it left out). Each row is a request
whose verdict (every asked fact shown, judged against the *request's* facts) training changed — fixed first,
then broken —, its frames before and after, and above each the prompt the generator was served (the refiner's
rewrite, or the request verbatim).

    OMP_NUM_THREADS=1 python -m experiments.request_sheet prompt_rl \\
        runs/rl_compare_sets/runs/prompt_rl_s0/checkpoints/last.ckpt --png docs/rl/prompt_rl_sheet.png
"""
from __future__ import annotations

import argparse

import torch

from bench.sheet import sheet
from experiments.rl_compare import BATCH, METHODS, NOISE_SEED, EvalSet, method_cli


def build(name: str, seed: int):
    module = method_cli(name, seed).model
    module.configure_model()
    return module.eval()


@torch.no_grad()
def serve(module, requests) -> tuple[torch.Tensor, list[str]]:
    """The system's videos of ``requests`` (as rl_compare evaluates) and what the generator was served."""
    texts, videos, served = [r.text for r in requests], [], []
    for k, i in enumerate(range(0, len(texts), BATCH)):
        videos.append(module.generate(texts[i:i + BATCH], seed=NOISE_SEED + k).float())
        served += [getattr(module, "served", {}).get(t, t) for t in texts[i:i + BATCH]]
    return torch.cat(videos), served


def main() -> None:
    from posttrain.modules.io import checkpoints

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("method", choices=[m for m, spec in METHODS.items() if spec.kind == "requests"])
    parser.add_argument("ckpt", help="the run's checkpoint folder (e.g. its last.ckpt)")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed (its refiners sample with it)")
    parser.add_argument("--png", required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    module = build(args.method, args.seed)
    data = EvalSet(frames=module.video.frames, height=module.video.height, width=module.video.width)
    requests = data.requests["seen"]
    before = serve(module, requests)
    checkpoint = checkpoints.load(args.ckpt)
    module.on_load_checkpoint(checkpoint)  # refuses another card's checkpoint, puts the frozen experts back
    module.load_state_dict(checkpoint["state_dict"])
    after = serve(module, requests)
    sheet(args.png, [r.text for r in requests], before[0], after[0], rows=10, facts=[r.facts for r in requests],
          served=(before[1], after[1]), what="held-out requests")
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
