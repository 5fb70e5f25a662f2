"""Why a refiner's right rewrites do not reach the video as well as the canonical captions do, measured.

For the requests of ``rl_compare.EVAL_SETS`` (64 a set, the training wording), every prompt below is served to the
generator with the noise ``rl_compare`` evaluates with (a set's batch ``i`` from ``noise_seed + i``: request ``j``
gets the same noise whatever it is served), and each video is judged against the facts the *request* asked
(synthetic GenEval, ``geneval.judge_facts``):

- ``caption``: the canonical caption of the asked facts (``requests.canonical_caption``), the reference;
- probes of the generator, each one change to that caption: ``full caption`` (the facts the request left out
  named too: extra words), ``fact order`` (the background before the motion), ``synonyms`` (the shape's and the
  colours' first train synonyms: ``crimson disc``), ``filler`` (``please make `` before it), and ``request``
  (the request verbatim);
- the refiner's rewrites: ``greedy`` (``requests.refine``, what ``rl_compare`` reports as rewrite accuracy) and
  ``sampled`` (what the system serves: ``JointRL.refine`` at the refiners' temperature, seeded as ``generate``).

Each rewrite is then put in one class by what differs from the caption (``identical``, ``wrong facts``, ``extra
fact``, ``other order``, ``other wording``) and its video's score set beside the caption's on the same requests and
noise; a rewrite that is the caption gets the caption's verdicts exactly (same text, same noise), so any gap
comes from wording. Last, the reward the refiner is trained on (``IntentReward``'s mean over the asked facts, on
the training rollout's SDE samples) beside the score it is judged by (every asked fact shown, ODE serving).

    OMP_NUM_THREADS=1 python -m experiments.rewrite_gap                          # the shipped refiner
    OMP_NUM_THREADS=1 python -m experiments.rewrite_gap --ckpt runs/prompt_rl/checkpoints/last.ckpt

Prints a Markdown report (``--out`` writes it too); the measured figures are in ``docs/rl/rewrite_gap.md``.
"""
from __future__ import annotations

import argparse
import re
import time

import torch

from bench.served import served_verdicts
from experiments.rl_compare import BATCH, EVAL_SETS, EvalSet, method_cli
from posttrain.modules.world.requests import LEXICON, Request, accuracy, canonical_caption, refine, rewrite_verdicts
from posttrain.modules.world.requests import all_asked_right as right  # (B,) bool: every asked fact shown
from posttrain.modules.world.requests import share_of_asked_right as mean_of_asked  # IntentReward's `mean` total
from posttrain.modules.world.world import FACTS, Facts, parse_caption

PROBES = ("caption", "full caption", "fact order", "synonyms", "filler", "request")
CLASSES = ("identical", "wrong facts", "extra fact", "other order", "other wording")


def probe(request: Request, full: Facts, name: str) -> str:
    """The prompt of probe ``name`` for ``request`` (``full``: all four facts of its video)."""
    caption = request.caption
    if name == "caption":
        return caption
    if name == "full caption":
        return canonical_caption(full)
    if name == "fact order":  # "a red circle on a blue background moving left"
        facts = request.facts
        text = f"a {facts.colour + ' ' if facts.colour else ''}{facts.shape}"
        text += f" on a {facts.background} background" if facts.background else ""
        return text + (f" moving {facts.motion}" if facts.motion else "")
    if name == "synonyms":  # the world's word of the shape and the colours -> their first train synonym
        swap = {v: w.train[1] for kind in ("colour", "shape") for v, w in LEXICON[kind].items()}
        return " ".join(swap.get(word, word) for word in caption.split())
    if name == "filler":
        return "please make " + caption
    if name == "request":
        return request.text
    raise ValueError(f"unknown probe {name!r}; choose one of {PROBES}")


def classify(rewrite: str, request: Request) -> str:
    """What differs between a rewrite and the canonical caption of its request's facts."""
    text = " ".join(rewrite.split())
    if text == request.caption:
        return "identical"
    verdicts = rewrite_verdicts([text], [request.facts])
    if any(float(verdicts[f][0]) == 0.0 for f in FACTS):
        return "wrong facts"
    read = parse_caption(text)
    if any(getattr(request.facts, f) is None and getattr(read, f) is not None for f in FACTS):
        return "extra fact"
    if sorted(re.findall(r"[a-z]+", text)) == sorted(re.findall(r"[a-z]+", request.caption)):
        return "other order"
    return "other wording"


def verdicts_of(module, prompts: list[str], data: EvalSet, facts: list[Facts], sde: bool = False) -> torch.Tensor:
    """(B, 4) verdicts of ``prompts`` served with set ``data``'s noise (``bench.served.served_verdicts``)."""
    return served_verdicts(module, prompts, facts, data.noise_seed, BATCH, sde)


def score(table: torch.Tensor) -> dict[str, float]:
    return accuracy({f: table[:, i] for i, f in enumerate(FACTS)})


@torch.no_grad()
def measure(module, data: EvalSet) -> dict:
    requests = data.requests["seen"]
    facts = [r.facts for r in requests]
    full = [parse_caption(c) for c in data.captions]  # the same index, the same video facts
    name = module.card.refiners[0]
    out: dict = {"probes": {}, "rewrites": {}}
    for p in PROBES:
        out["probes"][p] = verdicts_of(module, [probe(r, f, p) for r, f in zip(requests, full)], data, facts)
    texts = [r.text for r in requests]
    greedy = refine(module.card[name], module.card.tokenizers[name], texts, module.templates[name],
                    max_new_tokens=module.max_new_tokens[name])
    sampled = []
    for seed, i in zip(data.noise_seeds(), range(0, len(texts), BATCH)):
        sampled += module.refine(texts[i:i + BATCH], seed=seed)[1]  # exactly what ``generate`` serves
    for kind, rewrites in (("greedy", greedy), ("sampled", sampled)):
        out["rewrites"][kind] = {"texts": rewrites, "classes": [classify(t, r) for t, r in zip(rewrites, requests)],
                                 "verdicts": verdicts_of(module, rewrites, data, facts)}
    out["train_sde"] = verdicts_of(module, sampled, data, facts, sde=True)  # the training reward's rollouts
    return out


def table(results: list[dict]) -> list[str]:
    """The Markdown report of ``measure`` over the sets (pooled: all requests of all sets)."""
    cat = lambda get: torch.cat([get(r) for r in results])  # noqa: E731
    caption = cat(lambda r: r["probes"]["caption"])
    lines = ["| prompt served (same requests, same noise) | GenEval, all asked facts | shape | "
             "caption right, this wrong | caption wrong, this right |", "|---|---|---|---|---|"]
    per_set = lambda get: " / ".join(f"{score(get(r))['all']:.3f}" for r in results)  # noqa: E731

    def row(label: str, get) -> str:
        t = cat(get)
        s = score(t)
        return (f"| {label} | {s['all']:.3f} (sets {per_set(get)}) | {s['shape']:.3f} | "
                f"{int((right(caption) & ~right(t)).sum())} | {int((~right(caption) & right(t)).sum())} |")

    for p in PROBES:
        lines.append(row(p, lambda r, p=p: r["probes"][p]))
    for kind in ("greedy", "sampled"):
        lines.append(row(f"refiner's rewrite, {kind}", lambda r, k=kind: r["rewrites"][k]["verdicts"]))
    lines += ["", "| rewrite | class (what differs from the caption) | n | rewrite's GenEval | the caption's GenEval, "
              "same requests and noise | gap |", "|---|---|---|---|---|---|"]
    for kind in ("greedy", "sampled"):
        classes = sum((r["rewrites"][kind]["classes"] for r in results), [])
        verdicts = cat(lambda r: r["rewrites"][kind]["verdicts"])
        rewrite_ok = torch.tensor([c != "wrong facts" for c in classes])
        for c in CLASSES:
            rows = torch.tensor([x == c for x in classes])
            if rows.any():
                a, b = right(verdicts[rows]).double().mean(), right(caption[rows]).double().mean()
                lines.append(f"| {kind} | {c} | {int(rows.sum())} | {a:.3f} | {b:.3f} | {a - b:+.3f} |")
        texts = sum((r["rewrites"][kind]["texts"] for r in results), [])
        captions = sum(([q.caption for q in r["requests"]] for r in results), [])
        longer = torch.tensor([len(t.strip()) - len(c) for t, c in zip(texts, captions)])
        for label, rows in (("right facts, shorter than the caption", rewrite_ok & (longer < 0)),
                            ("right facts, the caption's length", rewrite_ok & (longer == 0)),
                            ("right facts, longer than the caption", rewrite_ok & (longer > 0))):
            if rows.any():
                a, b = right(verdicts[rows]).double().mean(), right(caption[rows]).double().mean()
                lines.append(f"| {kind} | {label} | {int(rows.sum())} | {a:.3f} | {b:.3f} | {a - b:+.3f} |")
    sampled = cat(lambda r: r["rewrites"]["sampled"]["verdicts"])
    sde = cat(lambda r: r["train_sde"])
    r_train, ok_serve = mean_of_asked(sde), right(sampled).double()
    corr = torch.corrcoef(torch.stack([r_train.double(), ok_serve]))[0, 1]
    lines += ["", "| the sampled rewrites' videos | mean of the asked facts (the reward's total) | every asked fact "
              "(the judged score) |", "|---|---|---|",
              f"| SDE rollout (what the refiner is trained on) | {mean_of_asked(sde).mean():.3f} | "
              f"{right(sde).double().mean():.3f} |",
              f"| ODE serving (what it is judged by) | {mean_of_asked(sampled).mean():.3f} | "
              f"{right(sampled).double().mean():.3f} |",
              "", f"Per request, the training reward (SDE, mean) against the judged verdict (ODE, all): correlation "
              f"{float(corr):.3f} over {len(ok_serve)} requests."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="unified_rl", help="the rl_compare method whose config builds the system")
    parser.add_argument("--ckpt", help="a run's checkpoint (its trained refiner and generator); none: as shipped")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed")
    parser.add_argument("--num-eval", type=int, default=64, help="requests per evaluation set")
    parser.add_argument("--out", help="also write the Markdown report here")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.time()
    module = method_cli(args.method, args.seed).model
    module.configure_model()
    if args.ckpt:
        from posttrain.modules.io import checkpoints

        checkpoint = checkpoints.load(args.ckpt)
        module.on_load_checkpoint(checkpoint)
        module.load_state_dict(checkpoint["state_dict"])
    module.eval()
    results = []
    for seed, noise in EVAL_SETS:
        data = EvalSet(args.num_eval, module.video.frames, module.video.height, module.video.width, seed, noise)
        results.append(measure(module, data) | {"requests": data.requests["seen"]})
    lines = [f"System: `configs/{args.method}.yaml`" + (f", weights of `{args.ckpt}`" if args.ckpt else ", as shipped")
             + f"; {len(EVAL_SETS)} sets × {args.num_eval} requests (training wording), "
               f"refiner temperature {module.refiner_args.temperature}.", ""] + table(results)
    lines.append(f"\n({time.time() - start:.0f} s wall on {args.threads} thread(s))")
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
