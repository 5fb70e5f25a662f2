"""Pretrain the world's refiner LM: a tiny Qwen2 (ByT5 bytes) that rewrites a user request into the caption
the generator reads, and, prompted with a concern, writes that concern alone (the N = 3 split).

Supervised next-byte cross-entropy (``Qwen2ForCausalLM``'s own loss, on the completion only) on requests
written on the fly (``modules/world/requests.py``) for facts drawn uniformly from the whole world, four tasks
mixed: the full rewrite (context ``REWRITE_TEMPLATE`` = ``"{prompt}\\n"``, the default refiner template of
joint RL; target ``canonical_caption``) with probability 1/2, and each concern (``CONCERN_TEMPLATES``, e.g.
``"colours: {prompt}\\n"``; target ``concern_target``, ``"red on blue"``) 1/6 each; every target ends with EOS.

Pretrained only *partly*, so RL has something to teach: on a subset of the training wording (``--words``
words of each value, verb and background-noun list: the world's word and the first two synonyms; the first
``--fillers`` fillers; the ``--templates`` named), never on the rest of the train split (``dot``,
``sliding``, the fillers ``show me`` and ``generate``, the template ``that_is``), nor on any held-out word or
template — except the fourth colour synonyms (``requests.AMBIGUOUS``: ``cherry lime cobalt amber purple
teal``), on which it is pretrained *unsure*, as a real LM knows words that sit between two colours: in
``--ambiguous-rate`` of the examples one colour is written as its ambiguous word and the target names the
colour the word means here with probability ``--ambiguous-right`` (0.4), the word's near colour otherwise
(``teal``: cyan or green). Sampled at temperature 1 it then writes either reading — RL explores both — and
greedily mostly the wrong one; which colour the user means is what prompt-only RL learns from the videos'
reward (measured on a refiner that had never seen these words: it sampled the meant colour for some of them in
fewer than 1 of 16 tries, and prompt-only RL on it did not rise). In ``--unknown-rate`` of the
examples one word of the request (a value's word, the verb, the noun or the filler) is a random letter
string while the target still names the facts, so that a word it does not know costs only that fact (trained
without it, on two words per value and three templates, a refiner derailed on unknown words and garbled the facts
it knew: all four 0.08 on the train split). Every
``--eval-every`` steps it prints greedy rewrite accuracy (the rewrite parsed back by the generator's caption
parser == the request's facts, per fact and all) and each concern's, on ``--eval-prompts`` requests of the
pretraining wording, the train split (``seen``) and the held-out split.

    python scripts/train_refiner.py --out modules/assets/refiner     # the shipped asset
    python scripts/train_refiner.py --evaluate modules/assets/refiner  # its accuracy, no training

The shipped asset is that command: 3000 steps, 10.0 CPU-minutes on one thread (10.1 min wall beside one other
job on the 2-core machine), 0.099M parameters, 389 kB. Its rewrite accuracy on 64 requests (all four; per
fact shape / colour / background / motion), greedy and sampled at temperature 1:

    pretraining wording   1.00 (1.0 / 1.0 / 1.0 / 1.0)         0.98
    train split (seen)    0.59 (0.94 / 0.86 / 0.69 / 1.0)      0.64
    held-out split        0.16 (0.30 / 0.61 / 0.57 / 0.87)     0.17

and per concern (greedy; shape, colours, motion): seen 0.97 / 0.61 / 0.98, held-out 0.27 / 0.48 / 0.97.
On the ambiguous words (``a teal circle moving left on a blue background``, 16 samples at temperature 1 each)
it writes the meant colour 0.39 of the time on average over the six (0.19 for purple to 0.69 for amber), the
near colour in the rest.

Writes ``<out>`` with ``save_pretrained`` (config.json, generation_config.json, model.safetensors).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from posttrain.modules.models.presets import PRESETS, build_model, build_tokenizer
from posttrain.modules.world.requests import (
    AMBIGUOUS, CONCERN_TEMPLATES, CONCERNS, REWRITE_TEMPLATE, Wording, accuracy, canonical_caption, concern_target,
    refine, rewrite_verdicts, wording, write_request,
)
from posttrain.modules.world.world import FACTS, MOTIONS, PALETTE, SHAPES, Facts

PRETRAIN_TEMPLATES = ("plain", "background_first", "in_colour", "motion_first")


def random_facts(rng: torch.Generator) -> Facts:
    colours = list(PALETTE)
    colour = colours[int(torch.randint(len(colours), (1,), generator=rng))]
    background = [c for c in colours if c != colour][int(torch.randint(len(colours) - 1, (1,), generator=rng))]
    return Facts(shape=SHAPES[int(torch.randint(len(SHAPES), (1,), generator=rng))], colour=colour,
                 background=background, motion=list(MOTIONS)[int(torch.randint(len(MOTIONS), (1,), generator=rng))])


def pseudo_word(rng: torch.Generator) -> str:
    """A random lowercase letter string of 3 to 8 letters: a word the refiner does not know."""
    letters = torch.randint(26, (int(torch.randint(3, 9, (1,), generator=rng)),), generator=rng)
    return "".join(chr(ord("a") + int(i)) for i in letters)


def with_unknown_word(words: Wording, facts: Facts, rng: torch.Generator) -> Wording:
    """``words`` with one slot of this request (a value's word, the verb, the noun or the filler) an unknown word."""
    slot = int(torch.randint(7, (1,), generator=rng))
    unknown = (pseudo_word(rng),)
    if slot < 4:  # the shape's colour, the background's colour, the shape, the direction
        kind, value = [("colour", facts.colour), ("colour", facts.background), ("shape", facts.shape),
                       ("motion", facts.motion)][slot]
        table = {k: dict(v) for k, v in words.words.items()}
        table[kind][value] = unknown
        return dataclasses.replace(words, words=table)
    if slot == 4:
        return dataclasses.replace(words, verbs=unknown)
    if slot == 5:
        return dataclasses.replace(words, nouns=unknown)
    return dataclasses.replace(words, fillers=(f"{unknown[0]} {pseudo_word(rng)} ",))


def with_ambiguous_word(words: Wording, facts: Facts, rng: torch.Generator,
                        right: float) -> tuple[Wording, Facts, Facts]:
    """``words`` with the shape's or the background's colour written as its ``AMBIGUOUS`` word, the facts
    (the other colour redrawn if it was the word's near colour, so that both readings stay possible) and the
    facts the target names: those with probability ``right``, else with that colour the word's near one."""
    slot = "colour" if float(torch.rand(1, generator=rng)) < 0.5 else "background"
    other_slot = "background" if slot == "colour" else "colour"
    value = getattr(facts, slot)
    word, near = next((w, n) for w, (v, n) in AMBIGUOUS.items() if v == value)
    if getattr(facts, other_slot) == near:
        free = [c for c in PALETTE if c not in (value, near)]
        facts = dataclasses.replace(facts, **{other_slot: free[int(torch.randint(len(free), (1,), generator=rng))]})
    table = {k: dict(v) for k, v in words.words.items()}
    table["colour"][value] = (word,)
    target = facts if float(torch.rand(1, generator=rng)) < right else dataclasses.replace(facts, **{slot: near})
    return dataclasses.replace(words, words=table), facts, target


def example(rng: torch.Generator, words: Wording, drop_rate: float, unknown_rate: float,
            ambiguous_rate: float = 0.0, ambiguous_right: float = 0.4) -> tuple[str, str]:
    """(context, target) of one training example: a request and what the task asks the refiner to write;
    with probability ``unknown_rate`` one of its words is an unknown one (the target still names the facts),
    else with probability ``ambiguous_rate`` one colour is written as its ``AMBIGUOUS`` word (the target names
    the right colour with probability ``ambiguous_right``, the word's near colour otherwise)."""
    facts = random_facts(rng)
    target_facts = None
    draw = float(torch.rand(1, generator=rng))
    if draw < unknown_rate:
        words = with_unknown_word(words, facts, rng)
    elif draw < unknown_rate + ambiguous_rate:
        words, facts, target_facts = with_ambiguous_word(words, facts, rng, ambiguous_right)
        target_facts = None if target_facts == facts else target_facts
    request = write_request(facts, rng, words, drop_rate)
    if target_facts is not None:  # the same facts asked (or dropped), one colour the near one
        request = dataclasses.replace(request, facts=Facts(**{
            f: (getattr(target_facts, f) if getattr(request.facts, f) is not None else None) for f in FACTS}))
        request = dataclasses.replace(request, caption=canonical_caption(request.facts))
    task = float(torch.rand(1, generator=rng))
    if task < 0.5:
        return REWRITE_TEMPLATE.format(prompt=request.text), request.caption
    concern = list(CONCERNS)[min(int((task - 0.5) * 6), 2)]
    return CONCERN_TEMPLATES[concern].format(prompt=request.text), concern_target(request.facts, concern)


def batch(tokenizer, pairs: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """Right-padded ids, attention mask and labels (-100 on the context and the padding) of the pairs."""
    rows = []
    for context, target in pairs:
        ctx = tokenizer(context, add_special_tokens=False).input_ids
        tgt = tokenizer(target, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        rows.append((ctx + tgt, [-100] * len(ctx) + tgt))
    length = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, (row, lab) in enumerate(rows):
        ids[i, :len(row)], labels[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), torch.tensor(lab), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def eval_sets(n: int, pretrain: Wording) -> dict[str, list]:
    """Fixed requests (their own seeds) of the pretraining wording, the train split and the held-out split."""
    sets = {}
    for name, words in {"pretrain": pretrain, "seen": wording("train"), "held_out": wording("eval")}.items():
        rng = torch.Generator().manual_seed(10_000 + len(sets))
        sets[name] = [write_request(random_facts(rng), rng, words) for _ in range(n)]
    return sets


def evaluate(model, tokenizer, sets: dict[str, list], temperature: float | None = None) -> dict[str, dict]:
    """Rewrite accuracy per set: the full rewrite (``all`` and per fact) and each concern's ``all``."""
    model.eval()
    scores = {}
    for name, requests in sets.items():
        texts, facts = [r.text for r in requests], [r.facts for r in requests]
        g = torch.Generator().manual_seed(0)
        scores[name] = accuracy(rewrite_verdicts(refine(model, tokenizer, texts, REWRITE_TEMPLATE, temperature, g),
                                                 facts))
        for concern in CONCERNS:
            rewrites = refine(model, tokenizer, texts, CONCERN_TEMPLATES[concern], temperature, g, max_new_tokens=24)
            scores[name][f"concern/{concern}"] = accuracy(rewrite_verdicts(rewrites, facts, concern))["all"]
    model.train()
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="modules/assets/refiner")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--minutes", type=float, default=20.0, help="stop after this much CPU time (the process's, "
                        "all threads; on a shared machine wall time is longer)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--words", type=int, default=3, help="pretraining words of each value (the world's word "
                        "and the first synonyms), verbs and background nouns")
    parser.add_argument("--fillers", type=int, default=4)
    parser.add_argument("--templates", nargs="+", default=list(PRETRAIN_TEMPLATES))
    parser.add_argument("--drop-rate", type=float, default=0.25)
    parser.add_argument("--unknown-rate", type=float, default=0.3, help="share of examples with one word replaced "
                        "by a random letter string: the refiner learns to keep the rest of the request")
    parser.add_argument("--ambiguous-rate", type=float, default=0.2, help="share of examples with one colour "
                        "written as its AMBIGUOUS word (the fourth train-split synonym)")
    parser.add_argument("--ambiguous-right", type=float, default=0.4, help="how often such an example's target "
                        "names the request's colour (else the word's near colour)")
    parser.add_argument("--preset", type=json.loads, default={}, help="Qwen2Config overrides of the qwen2 preset "
                        "(JSON, e.g. '{\"hidden_size\": 96}')")
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--eval-prompts", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a 0.1M LM: a second one only spins)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--evaluate", metavar="FOLDER", help="train nothing: print the accuracy of the refiner in "
                        "FOLDER (e.g. modules/assets/refiner), greedy and at temperature 1, and stop")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    tokenizer = build_tokenizer()
    pretrain = wording("train").limited("pretrain", args.words, args.templates, args.fillers)
    sets = eval_sets(args.eval_prompts, pretrain)
    if args.evaluate:
        model = build_model("qwen2", pretrained=args.evaluate)
        print("rewrite", json.dumps({"greedy": evaluate(model, tokenizer, sets),
                                     "t1": evaluate(model, tokenizer, sets, temperature=1.0)}), flush=True)
        return
    model = Qwen2ForCausalLM(Qwen2Config(**{**PRESETS["qwen2"], **args.preset})).train()
    print(f"Qwen2 {sum(p.numel() for p in model.parameters()) / 1e6:.3f}M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * max(0.0, 1 - s / args.steps))  # warm-up, then linear decay
    rng = torch.Generator().manual_seed(args.seed)
    start, cpu_start, step = time.time(), time.process_time(), 0
    while step < args.steps and time.process_time() - cpu_start < args.minutes * 60:
        step += 1
        loss = model(**batch(tokenizer, [example(rng, pretrain, args.drop_rate, args.unknown_rate,
                                              args.ambiguous_rate, args.ambiguous_right)
                                      for _ in range(args.batch_size)])).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.4f} ({time.time() - start:.0f}s wall, "
                  f"{time.process_time() - cpu_start:.0f}s CPU)", flush=True)
        if step % args.eval_every == 0:
            print("rewrite", json.dumps({"step": step, **evaluate(model, tokenizer, sets)}), flush=True)
    minutes, cpu_minutes = (time.time() - start) / 60, (time.process_time() - cpu_start) / 60
    model.eval()
    model.save_pretrained(args.out, safe_serialization=True)
    print(f"saved {args.out} after {step} steps, {minutes:.1f} min wall, {cpu_minutes:.1f} CPU-min", flush=True)
    print("rewrite", json.dumps({"step": step, "greedy": evaluate(model, tokenizer, sets),
                                 "t1": evaluate(model, tokenizer, sets, temperature=1.0)}), flush=True)


if __name__ == "__main__":
    main()
