"""User requests of the synthetic world: what people write when they want a video, with the facts they ask for.

The generator of the embedded world (``modules/assets/wan_t2v``) learnt one caption template,
``"a red circle moving left on a blue background"``. People write otherwise: ``"please make a navy
backdrop with a crimson disc drifting leftward"``. A *request* is such a text together with the
``Facts`` it asks for; a fact it leaves out is None (the shape is always asked: it is the request's
noun). A reward reads the facts, not the text (``modules/rewards/intent.py``), and a refiner LM rewrites the
request into the caption the generator reads (``canonical_caption``; ``served_prompt`` for the
``rewrite`` and ``append`` modes, ``compose_concerns`` for three refiners with one concern each).

The grammar (a request is a pure function of its facts and a ``torch.Generator``):

- words: each value of a fact has *train* words (the world's own word first, then synonyms) and
  *held-out* words (``LEXICON``); the motion is a verb (``VERBS``) and a direction phrase, the
  background a colour and a noun (``BACKGROUND_NOUNS``);
- templates: word orders with optional chunks, a chunk dropped when its fact is left out; five
  train templates and three held-out ones (``TEMPLATES``); fillers before some (``FILLERS``);
- a fact left out: with probability ``drop_rate`` one of colour, background or motion.

Split ``"train"`` uses only train words, templates and fillers; split ``"eval"`` only held-out ones
(no value word, verb, noun, filler or template of a held-out request occurs in a train request; the
templates' glue words, ``a``, ``is``, ``and``, are shared), so a score on ``"eval"`` measures wording never
trained on. The held-out words are relatives of train words or of the world's words
where English has one (``reddish``, ``disk``, ``leftwards``), readable from their bytes by a byte-level
LM; the others (``tile``, ``arrowhead``, ``canvas``, ``gliding``) no model here can know.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

import torch

from posttrain.modules.world.world import FACTS, Facts, parse_caption

Split = Literal["train", "eval"]
Mode = Literal["rewrite", "append"]


@dataclass(frozen=True)
class Words:
    """The surface forms of one value: ``train`` (the world's own word first) and ``held_out``."""

    train: tuple[str, ...]
    held_out: tuple[str, ...]

    def of(self, split: Split) -> tuple[str, ...]:
        return self.train if split == "train" else self.held_out


LEXICON: dict[str, dict[str, Words]] = {
    "colour": {  # the background's colour words are the same
        "red": Words(("red", "crimson", "scarlet", "cherry"), ("reddish",)),
        "green": Words(("green", "emerald", "jade", "lime"), ("greenish",)),
        "blue": Words(("blue", "azure", "navy", "cobalt"), ("bluish",)),
        "yellow": Words(("yellow", "golden", "lemon", "amber"), ("yellowish",)),
        "magenta": Words(("magenta", "fuchsia", "pink", "purple"), ("pinkish",)),
        "cyan": Words(("cyan", "turquoise", "aqua", "teal"), ("aquamarine",)),
    },
    "shape": {
        "circle": Words(("circle", "disc", "ball", "dot"), ("disk",)),
        "square": Words(("square", "box", "block"), ("tile",)),
        "triangle": Words(("triangle", "wedge", "pyramid"), ("arrowhead",)),
    },
    "motion": {  # the direction; the verb before it is one of VERBS
        "left": Words(("left", "leftward", "to the left"), ("leftwards",)),
        "right": Words(("right", "rightward", "to the right"), ("rightwards",)),
        "up": Words(("up", "upward", "to the top"), ("upwards",)),
        "down": Words(("down", "downward", "to the bottom"), ("downwards",)),
    },
}
# The train split's fourth colour words, each between two of the world's colours as the word is in English
# (word -> (the colour it names here, its near colour)). The shipped refiner is pretrained on them as a
# real LM knows such words, unsure (scripts/train_refiner.py: the named colour 40% of the time, the near
# one otherwise); which one the user means is what prompt-only RL learns from the video's reward.
AMBIGUOUS: dict[str, tuple[str, str]] = {
    "cherry": ("red", "magenta"), "lime": ("green", "yellow"), "cobalt": ("blue", "cyan"),
    "amber": ("yellow", "red"), "purple": ("magenta", "blue"), "teal": ("cyan", "green"),
}
VERBS = Words(("moving", "drifting", "heading", "sliding"), ("gliding",))
BACKGROUND_NOUNS = Words(("background", "backdrop", "field"), ("canvas",))
FILLERS = Words(("", "please make ", "i want ", "a video of ", "show me ", "generate "),
                ("could you render ", "i'd like "))

# A template is chunks (needs, text): a chunk whose fact ("colour", "motion", "background") the request
# leaves out is dropped; None = always written. Slots: {f} filler, {c} colour, {s} shape, {v} verb,
# {d} direction, {b} background colour, {n} background noun.
Template = tuple[tuple[Optional[str], str], ...]
TEMPLATES: dict[Split, dict[str, Template]] = {
    "train": {
        # "please make a crimson disc drifting leftward on a navy backdrop" (the caption's order)
        "plain": ((None, "{f}a "), ("colour", "{c} "), (None, "{s}"), ("motion", " {v} {d}"),
                  ("background", " on a {b} {n}")),
        # "i want a navy backdrop with a crimson disc drifting leftward"
        "background_first": ((None, "{f}"), ("background", "a {b} {n} with "), (None, "a "), ("colour", "{c} "),
                             (None, "{s}"), ("motion", " {v} {d}")),
        # "a video of a disc in crimson, drifting leftward, against a navy backdrop"
        "in_colour": ((None, "{f}a {s}"), ("colour", " in {c}"), ("motion", ", {v} {d}"),
                      ("background", ", against a {b} {n}")),
        # "drifting leftward: a crimson disc over a navy backdrop"
        "motion_first": (("motion", "{v} {d}: "), (None, "a "), ("colour", "{c} "), (None, "{s}"),
                         ("background", " over a {b} {n}")),
        # "show me a crimson disc that is drifting leftward, backdrop: navy"
        "that_is": ((None, "{f}a "), ("colour", "{c} "), (None, "{s}"), ("motion", " that is {v} {d}"),
                    ("background", ", {n}: {b}")),
    },
    "eval": {
        # "on a bluish canvas, a reddish disk is gliding leftwards"
        "setting_first": (("background", "on a {b} {n}, "), (None, "a "), ("colour", "{c} "), (None, "{s}"),
                          ("motion", " is {v} {d}")),
        # "i'd like a disk, reddish, gliding leftwards, bluish canvas"
        "list": ((None, "{f}a {s}"), ("colour", ", {c}"), ("motion", ", {v} {d}"), ("background", ", {b} {n}")),
        # "could you render the canvas bluish and a reddish disk gliding leftwards"
        "noun_first": ((None, "{f}"), ("background", "the {n} {b} and "), (None, "a "), ("colour", "{c} "),
                       (None, "{s}"), ("motion", " {v} {d}")),
    },
}
DROPPABLE = ("colour", "background", "motion")  # the shape is the request's noun: always asked

# The N = 3 split (``compose_concerns``): each refiner writes one concern, scored by the reward terms named.
CONCERNS: dict[str, tuple[str, ...]] = {"shape": ("shape",), "colours": ("colour", "background"),
                                        "motion": ("motion",)}
# The refiner's context for each task: the full rewrite reads ``refiners.DEFAULT_TEMPLATE``'s "{prompt}\n";
# a concern's refiner is told its concern before the request.
REWRITE_TEMPLATE = "{prompt}\n"
CONCERN_TEMPLATES = {concern: f"{concern}: {{prompt}}\n" for concern in CONCERNS}


@dataclass(frozen=True)
class Wording:
    """The choices a request is written from: the words of each value, the verbs, background nouns,
    fillers and templates (``wording(split)``; ``limited`` for a subset, e.g. a refiner's pretraining)."""

    name: str
    words: dict[str, dict[str, tuple[str, ...]]]  # fact kind ("colour", "shape", "motion") -> value -> words
    verbs: tuple[str, ...]
    nouns: tuple[str, ...]
    fillers: tuple[str, ...]
    templates: dict[str, Template]

    def limited(self, name: str, words: int, templates: Sequence[str], fillers: int) -> "Wording":
        """The first ``words`` words of each value, verb list and noun list, the first ``fillers`` fillers and
        the ``templates`` named."""
        unknown = [t for t in templates if t not in self.templates]
        if unknown or words < 1 or fillers < 1:
            raise ValueError(f"Wording.limited: words={words} and fillers={fillers} must be >= 1 and templates "
                             f"{unknown} unknown (known: {sorted(self.templates)})")
        return Wording(name, {kind: {v: ws[:words] for v, ws in values.items()} for kind, values in self.words.items()},
                       self.verbs[:words], self.nouns[:words], self.fillers[:fillers],
                       {t: self.templates[t] for t in templates})

    def vocabulary(self) -> set[str]:
        """Every word and filler phrase of this wording (templates' own words aside)."""
        words = {w for values in self.words.values() for ws in values.values() for w in ws}
        return words | set(self.verbs) | set(self.nouns) | {f.strip() for f in self.fillers if f.strip()}


def wording(split: Split) -> Wording:
    """The words, fillers and templates of ``split`` (``train``: the world's words and the train synonyms;
    ``eval``: only the held-out ones)."""
    if split not in TEMPLATES:
        raise ValueError(f"request split {split!r}; choose 'train' or 'eval'")
    return Wording(split, {kind: {v: w.of(split) for v, w in values.items()} for kind, values in LEXICON.items()},
                   VERBS.of(split), BACKGROUND_NOUNS.of(split), FILLERS.of(split), TEMPLATES[split])


@dataclass(frozen=True)
class Request:
    """One request: its ``text``, the ``facts`` it asks for, the ``caption`` that names exactly them in the
    generator's template, and how it was written (``template``, ``words`` per slot, the ``wording``'s name)."""

    text: str
    facts: Facts
    caption: str
    template: str
    wording: str
    words: dict[str, str] = field(default_factory=dict)


def canonical_caption(facts: Facts) -> str:
    """The world's caption of the facts asked, the parts of a fact left out dropped:
    ``"a red circle moving left on a blue background"``, ``"a circle moving left on a blue background"``."""
    if facts.shape is None:
        raise ValueError(f"canonical_caption: {facts} asks for no shape; a request's noun is its shape")
    text = f"a {facts.colour + ' ' if facts.colour else ''}{facts.shape}"
    if facts.motion:
        text += f" moving {facts.motion}"
    if facts.background:
        text += f" on a {facts.background} background"
    return text


def _pick(options: Sequence[str], rng: torch.Generator) -> str:
    return options[int(torch.randint(len(options), (1,), generator=rng))]


def write_request(facts: Facts, rng: torch.Generator, split: Split | Wording = "train",
                  drop_rate: float = 0.25) -> Request:
    """A request for ``facts`` (all four given) in ``split``'s words and templates (or a ``Wording``), drawn
    from ``rng``: with probability ``drop_rate`` one of colour, background, motion is left out (None in its
    facts). Articles follow the next word (``an emerald disc``)."""
    chosen = split if isinstance(split, Wording) else wording(split)
    if not 0.0 <= drop_rate <= 1.0:
        raise ValueError(f"drop_rate={drop_rate} must be in [0, 1] (the share of requests that leave a fact out)")
    missing = [f for f in FACTS if getattr(facts, f) is None]
    if missing:
        raise ValueError(f"write_request needs all four facts; {facts} lacks {missing}")
    name = _pick(sorted(chosen.templates), rng)
    drop = _pick(DROPPABLE, rng) if float(torch.rand(1, generator=rng)) < drop_rate else None
    asked = Facts(**{f: (None if f == drop else getattr(facts, f)) for f in FACTS})
    words = {
        "f": _pick(chosen.fillers, rng),
        "c": _pick(chosen.words["colour"][facts.colour], rng),
        "s": _pick(chosen.words["shape"][facts.shape], rng),
        "v": _pick(chosen.verbs, rng),
        "d": _pick(chosen.words["motion"][facts.motion], rng),
        "b": _pick(chosen.words["colour"][facts.background], rng),
        "n": _pick(chosen.nouns, rng),
    }
    text = "".join(chunk.format(**words) for needs, chunk in chosen.templates[name]
                   if needs is None or getattr(asked, needs) is not None)
    text = re.sub(r"\ba (?=[aeiou])", "an ", text)
    return Request(text, asked, canonical_caption(asked), name, chosen.name, words)


# ------------------------------------------------------------------------------------------------ reading
def _phrases() -> dict[tuple[str, ...], tuple[str, Optional[str]]]:
    table: dict[tuple[str, ...], tuple[str, Optional[str]]] = {}
    for kind, values in LEXICON.items():
        for value, words in values.items():
            for word in words.train + words.held_out:
                table[tuple(re.findall(r"[a-z]+", word))] = (kind, value)
    for noun in BACKGROUND_NOUNS.train + BACKGROUND_NOUNS.held_out:
        table[(noun,)] = ("noun", None)
    return table


_PHRASES = _phrases()
_LONGEST = max(len(k) for k in _PHRASES)


def parse_request(text: str) -> Facts:
    """The facts a request of this grammar (or a caption) asks for, from its words alone: the first shape
    word, the first direction phrase, a colour word right before or after a background noun as the
    background and the first other colour word as the shape's. Exact on every request ``write_request``
    writes (tested over the whole grammar); on other text a best reading."""
    words = re.findall(r"[a-z]+", text.lower())
    found: list[tuple[int, int, str, Optional[str]]] = []  # (first word, last word, kind, value)
    i = 0
    while i < len(words):
        for n in range(min(_LONGEST, len(words) - i), 0, -1):
            hit = _PHRASES.get(tuple(words[i:i + n]))
            if hit is not None:
                found.append((i, i + n - 1, *hit))
                i += n
                break
        else:
            i += 1
    nouns = {a for a, _, kind, _ in found if kind == "noun"}
    colours = [(a, b, value) for a, b, kind, value in found if kind == "colour"]
    background = next((v for a, b, v in colours if b + 1 in nouns or a - 1 in nouns), None)
    shape_colour = next((v for a, b, v in colours if not (b + 1 in nouns or a - 1 in nouns)), None)
    first = lambda kind: next((v for _, _, k, v in found if k == kind), None)  # noqa: E731
    return Facts(shape=first("shape"), colour=shape_colour, background=background, motion=first("motion"))


# ------------------------------------------------------------------------------------------------ serving
def served_prompt(request: str, refinement: Optional[str], mode: Mode = "rewrite", separator: str = ", ") -> str:
    """The prompt the generator is served for ``request`` and a refiner's ``refinement`` of it.

    ``rewrite``: the refinement replaces the request (stripped; an empty rewrite serves the empty prompt,
    which the reward then scores: the refiner's action is exactly what the generator saw). ``append``:
    ``request + separator + refinement`` (``refiners.compose_prompt``). ``refinement=None`` means the
    sample was not refined (joint RL's skip samples): the request verbatim, in both modes."""
    if mode not in ("rewrite", "append"):
        raise ValueError(f"refinement mode {mode!r}; choose 'rewrite' (the refinement replaces the request) or "
                         f"'append' (it follows the request)")
    if refinement is None:
        return request
    if mode == "rewrite":
        return refinement.strip()
    return separator.join([request] + ([refinement.strip()] if refinement.strip() else []))


def concern_target(facts: Facts, concern: str) -> str:
    """What the refiner of ``concern`` should write for ``facts``: the shape word (``"circle"``), the colours
    (``"red on blue"``; ``"red"`` or ``"on blue"`` when one is left out) or the direction (``"left"``; ``""``
    when the motion is left out)."""
    if concern == "shape":
        return facts.shape or ""
    if concern == "colours":
        return " ".join(p for p in (facts.colour, f"on {facts.background}" if facts.background else None) if p)
    if concern == "motion":
        return facts.motion or ""
    raise ValueError(f"unknown concern {concern!r}; choose one of {list(CONCERNS)}")


def compose_concerns(shape: str, colours: str, motion: str) -> str:
    """The served prompt of three refiners with one concern each, in the generator's caption template:
    ``"a {colour} {shape} moving {motion} on a {background} background"``, where ``colours`` is split at
    its word ``on`` into the shape's colour (before) and the background's (after), and an empty part drops
    its words. Each refiner's text lands verbatim in its own slots, so what one writes moves only the facts
    its reward term scores (``IntentReward(concerns=...)``); the targets compose into the caption:
    ``compose_concerns(*(concern_target(f, c) for c in CONCERNS)) == canonical_caption(f)``."""
    shape, colours, motion = shape.strip(), " ".join(colours.split()), motion.strip()
    match = re.match(r"^(.*?)(?:^|\s)on(?:\s(.*))?$", colours)
    colour, background = ((match.group(1) or "").strip(), (match.group(2) or "").strip()) if match else (colours, "")
    text = " ".join(p for p in ("a", colour, shape) if p)
    if motion:
        text += f" moving {motion}"
    if background:
        text += f" on a {background} background"
    return text


def serve(request: str, refinements: Optional[Sequence[str]], mode: Mode = "rewrite",
          concerns: Optional[Sequence[str]] = None) -> str:
    """The prompt the generator is served for ``request`` and the texts of N refiners (in refiner order).

    ``refinements=None``: an unrefined sample (joint RL's skip samples), the request verbatim. With
    ``concerns`` (refiner i writes concern ``concerns[i]``), the texts compose into the caption template
    (``compose_concerns``); without, the non-empty texts join with ``", "`` (one refiner: its text). Then
    ``served_prompt`` in ``mode``: the composition replaces the request (``rewrite``) or follows it (``append``;
    without concerns that is ``refiners.compose_prompt(request, refinements)``)."""
    if refinements is None:
        return served_prompt(request, None, mode)
    if concerns is not None:
        if len(concerns) != len(refinements):
            raise ValueError(f"serve: {len(refinements)} refinements for {len(concerns)} concerns {list(concerns)}")
        parts = {concern: "" for concern in CONCERNS}
        parts.update(zip(concerns, refinements))
        return served_prompt(request, compose_concerns(**parts), mode)
    return served_prompt(request, ", ".join(t.strip() for t in refinements if t.strip()), mode)


def refinement_tokens(concern: Optional[str] = None) -> int:
    """A refiner's token budget for its task, in byte tokens: the longest text it is meant to write for any facts
    of the world (``canonical_caption`` for the full rewrite, ``concern_target`` for a concern) plus its EOS,
    rounded up to a multiple of 8 (the full rewrite: 56; shape, colours, motion: 16, 24, 8)."""
    from itertools import product

    from posttrain.modules.world.world import MOTIONS, PALETTE, SHAPES

    every = [Facts(s, c, b, m) for s, c, b, m in product(SHAPES, PALETTE, PALETTE, MOTIONS) if c != b]
    write = canonical_caption if concern is None else (lambda f: concern_target(f, concern))
    longest = max(len(write(f).encode()) for f in every) + 1
    return -(-longest // 8) * 8


def facts_from_batch(batch: dict) -> list[Facts]:
    """The ``Facts`` of a collated batch of ``datamodules.requests.Requests`` (one list of strings per fact,
    ``""`` where the request leaves the fact out)."""
    missing = [f for f in FACTS if f not in batch]
    if missing:
        raise KeyError(f"the batch carries no facts {missing}: load requests with datamodules.requests.Requests")
    return [Facts(**{f: (batch[f][b] or None) for f in FACTS}) for b in range(len(batch[FACTS[0]]))]


# ------------------------------------------------------------------------------------------------ refining
@torch.no_grad()
def refine(model: torch.nn.Module, tokenizer, requests: Sequence[str], template: str = REWRITE_TEMPLATE,
           temperature: Optional[float] = None, generator: Optional[torch.Generator] = None,
           max_new_tokens: int = 64) -> list[str]:
    """A refiner LM's text for each request: greedy (``temperature=None``: transformers' ``generate``, the
    tokens ``refiners.refiner_vocab`` allows) or sampled as joint RL samples (``refiners.sample_refinements``
    at ``temperature`` from ``generator``). ``template`` is the LM's context (``CONCERN_TEMPLATES`` for one
    concern)."""
    from posttrain.modules.models.refiners import encode_contexts, refiner_vocab, sample_refinements

    if temperature is not None:
        if generator is None:
            raise ValueError("refine: sampling at a temperature needs a torch.Generator (seeded: reproducible)")
        return sample_refinements(model, tokenizer, list(requests), generator, max_new_tokens, temperature,
                                  template).texts
    vocab = refiner_vocab(tokenizer, model.get_output_embeddings().weight.shape[0])
    ids, mask = encode_contexts(tokenizer, list(requests), template, vocab.pad_id)
    device = next(model.parameters()).device
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                         do_sample=False, suppress_tokens=(~vocab.allowed).nonzero()[:, 0].tolist(),
                         eos_token_id=vocab.eos_id, pad_token_id=vocab.pad_id)
    completions = out[:, ids.shape[1]:].tolist()
    return [tokenizer.decode(row[: row.index(vocab.eos_id)] if vocab.eos_id in row else row,
                             skip_special_tokens=True) for row in completions]


def rewrite_verdicts(rewrites: Sequence[str], asked: Sequence[Facts],
                     concern: Optional[str] = None) -> dict[str, torch.Tensor]:
    """Whether each rewrite names the facts its request asked, as the generator's caption parser reads it
    (``world.parse_caption``): ``{fact: (B,)}`` 1.0 / 0.0, NaN where the request leaves the fact out. With
    ``concern``, the rewrites are that concern's part alone, read through ``compose_concerns`` (and only the
    concern's facts are judged)."""
    if len(rewrites) != len(asked):
        raise ValueError(f"rewrite_verdicts: {len(rewrites)} rewrites for {len(asked)} requests")
    if concern is not None and concern not in CONCERNS:
        raise ValueError(f"unknown concern {concern!r}; choose one of {list(CONCERNS)}")
    verdicts = {fact: torch.full((len(asked),), float("nan")) for fact in FACTS}
    for b, (text, facts) in enumerate(zip(rewrites, asked)):
        if concern is not None:
            text = compose_concerns(**{c: (text if c == concern else "") for c in CONCERNS})
        read = parse_caption(text)
        for fact in CONCERNS[concern] if concern else FACTS:
            if getattr(facts, fact) is not None:
                verdicts[fact][b] = float(getattr(read, fact) == getattr(facts, fact))
    return verdicts


def all_asked_right(table: torch.Tensor) -> torch.Tensor:
    """(B,) bool of a (B, facts) verdict table (1 / 0 / NaN where the fact is not asked): every asked fact right."""
    return (table.nan_to_num(1.0) == 1).all(1)


def share_of_asked_right(table: torch.Tensor) -> torch.Tensor:
    """(B,) the share of the asked facts right of a (B, facts) verdict table (0 where none is asked)."""
    return table.nan_to_num(0.0).sum(1) / (~table.isnan()).sum(1).clamp(min=1)


def faithful_rows(served: Sequence[str], asked: Sequence[Facts]) -> torch.Tensor:
    """(B,) bool: the served prompt names every fact its request asked, read as the generator's captions are
    (``rewrite_verdicts``; a fact the request leaves out may be named or not)."""
    verdicts = rewrite_verdicts(served, asked)
    return all_asked_right(torch.stack([verdicts[f] for f in FACTS], dim=1))


def accuracy(verdicts: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per fact, the share right among the samples asking it (NaN when none does); ``all``, the share of the
    samples asking any fact that get every fact they ask right; ``n``, how many those are. ``verdicts``:
    ``{fact: (B,)}`` 1 / 0 / NaN (``geneval.judge_facts``, ``rewrite_verdicts``)."""
    table = torch.stack([verdicts[f] for f in FACTS], dim=1).double()  # (B, 4)
    asked = ~table.isnan()
    scores = {f: round(float(table[asked[:, i], i].mean()), 3) if asked[:, i].any() else float("nan")
              for i, f in enumerate(FACTS)}
    rows = asked.any(1)
    scores["all"] = round(float(all_asked_right(table[rows]).double().mean()), 3)
    scores["n"] = int(rows.sum())
    return scores
