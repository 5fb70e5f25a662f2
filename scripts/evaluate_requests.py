"""The gap a refiner can climb: the shipped generator on user requests, served verbatim, against the same
requests' canonical captions, scored on the request's facts (``IntentReward``'s synthetic GenEval).

``--prompts`` requests of the seen-concept facts (the shipped generator never saw magenta; facts of
``ShapesDataset(seed=2)``, as ``scripts/train_world.py --evaluate`` draws them) in two wordings with the same
facts: ``seen`` (the training grammar of ``modules/world/requests.py``) and ``held_out`` (held-out words and
templates only). Each is served as the request itself, as its canonical caption and, with ``--refiner``, as
the refiner's rewrite (greedy and sampled at ``--temperature``); a served text and its caption share their
noise (batch ``i`` from seed ``i``), as ``train_world.py --evaluate`` samples: 20 Euler steps, shift 3, at
each ``--guidance`` (1.0: no CFG, how RL rolls out; 4.5: how Wan serves).

    python scripts/evaluate_requests.py                                   # about 9 CPU-min
    python scripts/evaluate_requests.py --refiner modules/assets/refiner  # + served through the refiner
    python scripts/evaluate_requests.py --refiner modules/assets/refiner --served refiner_greedy refiner_t1

Prints one JSON line per (guidance, split, served): per-fact accuracy over the requests asking that fact
and ``all`` (every fact the request asks is shown). On the shipped assets (the second command: 45 min wall,
17.7 CPU-min on the shared 2-core machine; the refiner's rows again with the third after the refiner was
retrained), all (shape / colour / background / motion), 64 requests a split:

    served               seen, no CFG                  held-out, no CFG              seen, CFG 4.5   held-out, CFG 4.5
    caption              0.656 (0.70/0.98/1.00/0.95)   0.656 (the same captions)     0.922           0.922
    request verbatim     0.031 (0.27/0.18/0.23/0.33)   0.000 (0.13/0.30/0.16/0.23)   0.016           0.000
    refiner, greedy      0.312 (0.63/0.63/0.58/0.77)   0.109 (0.25/0.33/0.53/0.77)   0.406           0.094
    refiner, t = 1       0.328 (0.61/0.63/0.66/0.79)   0.047 (0.20/0.28/0.40/0.67)   0.438           0.016

(the refiner's rewrites of these requests name every fact asked for 0.47 / 0.50 of the seen ones, greedy /
t = 1, and 0.05 / 0.00 of the held-out ones). At ``--text-max-length 96`` the captions score 0.562 / 0.891
and the requests 0.016 / 0.031 (seen) and 0.0 / 0.0 (held-out).
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from posttrain.datamodules.requests import RequestDataset
from posttrain.datamodules.synthetic import PRETRAIN_EXCLUDE
from posttrain.modules.models import presets
from posttrain.modules.eval.evaluation import generate
from posttrain.modules.world.geneval import judge_facts
from posttrain.modules.world.requests import REWRITE_TEMPLATE, accuracy, refine, rewrite_verdicts
from posttrain.modules.flow.samplers import FlowMatchSampler

SPLITS = {"seen": "train", "held_out": "eval"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--assets", default=os.path.dirname(presets.TRAINED_ASSETS["wan_t2v"]),
                        help="folder with the umt5, wan_t2v and wan_vae to evaluate")
    parser.add_argument("--prompts", type=int, default=64, help="requests per split")
    parser.add_argument("--guidance", type=float, nargs="+", default=[1.0, 4.5])
    parser.add_argument("--refiner", help="a refiner folder (e.g. modules/assets/refiner): serve its rewrites too")
    parser.add_argument("--temperature", type=float, default=1.0, help="the refiner's sampling temperature")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--text-max-length", type=int, default=64, help="text tokens (bytes) the generator reads: "
                        "64 as it was trained (a longer request is cut; at 96 its captions score lower, the "
                        "zero-padded text states shift its cross-attention)")
    parser.add_argument("--served", nargs="+", metavar="NAME", help="only these rows (caption, request, "
                        "refiner_greedy, refiner_t1): e.g. the refiner's after retraining it")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = presets.build_tokenizer()
    encoder = presets.build_model("umt5", pretrained=os.path.join(args.assets, "umt5")).eval()
    transformer = presets.build_model("wan_t2v", pretrained=os.path.join(args.assets, "wan_t2v")).eval()
    vae = presets.build_model("wan_vae", pretrained=os.path.join(args.assets, "wan_vae")).eval()
    refiner = presets.build_model("qwen2", pretrained=args.refiner).eval() if args.refiner else None

    for split, grammar in SPLITS.items():
        data = RequestDataset(args.prompts, seed=2, split=grammar, exclude=PRETRAIN_EXCLUDE)
        requests = [data.request(i) for i in range(len(data))]
        facts = [r.facts for r in requests]
        served = {"caption": [r.caption for r in requests], "request": [r.text for r in requests]}
        if refiner is not None:
            texts = [r.text for r in requests]
            served["refiner_greedy"] = refine(refiner, tokenizer, texts, REWRITE_TEMPLATE)
            served[f"refiner_t{args.temperature:g}"] = refine(refiner, tokenizer, texts, REWRITE_TEMPLATE,
                                                               temperature=args.temperature,
                                                               generator=torch.Generator().manual_seed(0))
            for name in [k for k in served if k.startswith("refiner")]:
                print("rewrite", json.dumps({"split": split, "served": name,
                                             **accuracy(rewrite_verdicts(served[name], facts))}), flush=True)
        if args.served:
            unknown = sorted(set(args.served) - set(served))
            if unknown:
                parser.error(f"--served {unknown}: choose from {sorted(served)}")
            served = {name: prompts for name, prompts in served.items() if name in args.served}
        for guidance in args.guidance:
            sampler = FlowMatchSampler(num_steps=20, guidance_scale=guidance)
            for name, prompts in served.items():
                verdicts: dict[str, list[torch.Tensor]] = {}
                for i in range(0, len(prompts), args.batch_size):
                    videos = generate(transformer, encoder, tokenizer, vae, prompts[i:i + args.batch_size],
                                      seed=i // args.batch_size, sampler=sampler,
                                      text_max_length=args.text_max_length)
                    for fact, v in judge_facts(videos, facts[i:i + args.batch_size]).items():
                        verdicts.setdefault(fact, []).append(v)
                scores = accuracy({fact: torch.cat(v) for fact, v in verdicts.items()})
                print("geneval", json.dumps({"guidance": guidance, "split": split, "served": name, **scores}),
                      flush=True)


if __name__ == "__main__":
    main()
