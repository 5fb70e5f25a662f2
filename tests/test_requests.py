"""User requests (modules/world/requests.py, datamodules/requests.py), the intent reward (modules/rewards/intent.py) and the
shipped refiner asset (modules/assets/refiner, scripts/train_refiner.py)."""
from __future__ import annotations

import os
import re

import pytest
import torch

from posttrain.datamodules.requests import RequestDataset, Requests
from posttrain.modules.models import presets
from posttrain.modules.rewards.intent import IntentReward
from posttrain.modules.world.requests import (
    AMBIGUOUS, CONCERN_TEMPLATES, CONCERNS, FILLERS, LEXICON, REWRITE_TEMPLATE, TEMPLATES, accuracy, canonical_caption,
    compose_concerns, concern_target, facts_from_batch, parse_request, refine, rewrite_verdicts, served_prompt,
    wording,
)
from posttrain.modules.rewards.base import score, term_of
from posttrain.modules.world.world import FACTS, PALETTE, Facts, parse_caption, render

SPLITS = ("train", "eval")


def requests(split: str, n: int, seed: int = 0, **kwargs) -> list:
    data = RequestDataset(n, seed=seed, split=split, **kwargs)
    return [data.request(i) for i in range(n)]


def video_of(facts: Facts, fill: Facts = Facts("circle", "red", "blue", "left")) -> torch.Tensor:
    """(3, F, H, W) rendered video of ``facts``, a fact left out taken from ``fill`` (colours kept apart)."""
    colour = facts.colour or next(c for c in (fill.colour, "green") if c != facts.background)
    background = facts.background or next(c for c in (fill.background, "yellow") if c != colour)
    return render(facts.shape, colour, facts.motion or fill.motion, background, 5, 32, 32)


# ------------------------------------------------------------------------------------------------ grammar
@pytest.mark.parametrize("split", SPLITS)
def test_every_request_reads_back_as_the_facts_it_carries(split):
    """Over 1500 requests of a split (every template, word and left-out fact): the grammar's reader finds
    the facts from the text alone, the generator's caption parser finds them in the caption, and the three
    concern targets compose into that caption. A fact left out is None, and some requests leave one out."""
    batch = requests(split, 1500)
    assert {r.template for r in batch} == set(TEMPLATES[split])
    dropped = [r for r in batch if any(getattr(r.facts, f) is None for f in FACTS)]
    assert 0.15 < len(dropped) / len(batch) < 0.35 and all(r.facts.shape for r in batch)
    for r in batch:
        assert parse_request(r.text) == r.facts, r
        assert parse_caption(r.caption) == r.facts == parse_request(r.caption), r
        assert compose_concerns(*(concern_target(r.facts, c) for c in CONCERNS)) == r.caption
    assert canonical_caption(Facts("circle", "red", "blue", "left")) == "a red circle moving left on a blue background"


def test_the_split_keeps_held_out_words_and_templates_out_of_training():
    """No train request uses a held-out template, word or filler (whole words; fillers as phrases), every
    held-out request uses only held-out words, and the two vocabularies are disjoint."""
    held_words = {w for values in LEXICON.values() for words in values.values() for w in words.held_out}
    assert not wording("train").vocabulary() & wording("eval").vocabulary()
    for r in requests("train", 2000, seed=1):
        assert r.template in TEMPLATES["train"] and r.template not in TEMPLATES["eval"]
        assert not set(re.findall(r"[a-z]+", r.text)) & held_words, r.text
        assert not any(f.strip() in r.text for f in FILLERS.held_out if f.strip()), r.text
    train_vocab = wording("train").vocabulary()
    for r in requests("eval", 500, seed=1):
        assert r.template in TEMPLATES["eval"]
        assert all(w not in train_vocab for slot, w in r.words.items() if w.strip()), r.words


def test_requests_are_deterministic_and_carry_their_facts_in_the_batch():
    """A request is a function of (seed, index, split); a batch carries the request, its caption and one
    string per fact ("" where left out); the validation split is held-out wording by default, over the
    indices after the training ones; bad options are refused by name."""
    assert [r.text for r in requests("train", 20)] == [r.text for r in requests("train", 20)]
    assert [r.text for r in requests("train", 20)] != [r.text for r in requests("train", 20, seed=1)]
    data = Requests(num_requests=8, val_requests=4, batch_size=4, exclude=["magenta"])
    batch = next(iter(data.train_dataloader()))
    facts = facts_from_batch(batch)
    assert all(parse_request(p) == f for p, f in zip(batch["prompt"], facts))
    assert [canonical_caption(f) for f in facts] == list(batch["caption"])
    assert not any("magenta" in c for c in batch["caption"])
    val = next(iter(data.val_dataloader()))
    assert val["index"].tolist() == [8, 9, 10, 11]
    assert all(RequestDataset(12, split="eval", exclude=["magenta"]).request(i).text == p
               for i, p in zip(val["index"].tolist(), val["prompt"]))
    with pytest.raises(ValueError, match=r"val_split='both'.*'held_out' or 'seen'"):
        Requests(val_split="both")
    with pytest.raises(ValueError, match=r"drop_rate=1.5 must be in \[0, 1\]"):
        Requests(drop_rate=1.5)
    with pytest.raises(KeyError, match="carries no facts"):
        facts_from_batch({"prompt": ["a red circle"]})


def test_served_prompt_rewrites_or_appends():
    """rewrite: the refinement replaces the request; append: it follows it; None (not refined): the request."""
    request = "please make a crimson disc"
    assert served_prompt(request, " a red circle ", "rewrite") == "a red circle"
    assert served_prompt(request, "a red circle", "append") == "please make a crimson disc, a red circle"
    assert served_prompt(request, "", "rewrite") == "" and served_prompt(request, "", "append") == request
    assert served_prompt(request, None, "rewrite") == request == served_prompt(request, None, "append")
    with pytest.raises(ValueError, match="refinement mode 'replace'"):
        served_prompt(request, "x", "replace")


def test_concern_parts_land_in_their_own_slots():
    """Each refiner's text goes verbatim into its slots of the caption template: a wrong shape word changes
    only the shape the caption parser reads, a wrong colour part only the colours."""
    assert compose_concerns("circle", "red on blue", "left") == "a red circle moving left on a blue background"
    assert compose_concerns("circle", "on blue", "") == "a circle on a blue background"
    assert compose_concerns("circle", "red", "left") == "a red circle moving left"
    wrong_shape = parse_caption(compose_concerns("square", "red on blue", "left"))
    wrong_colours = parse_caption(compose_concerns("circle", "green on cyan", "left"))
    assert wrong_shape == Facts("square", "red", "blue", "left")
    assert wrong_colours == Facts("circle", "green", "cyan", "left")


# ------------------------------------------------------------------------------------------------ reward
def test_the_request_reward_scores_intent_not_wording(one_thread):
    """One video per request scores the same under the request and under its canonical caption (1 on every
    fact asked: the video shows them), and the same again when a wrong text was served and the request is
    the original prompt, or the facts come in the context; a video of other facts scores 0, a fact the
    request leaves out is not scored."""
    batch = [r for r in requests("eval", 40, seed=3) if r.facts.background is not None][:6]
    batch += [r for r in requests("train", 40, seed=3) if r.facts.background is None][:2]
    videos = torch.stack([video_of(r.facts) for r in batch])
    reward = IntentReward()
    under_request = score(reward, videos, [r.text for r in batch])
    under_caption = score(reward, videos, [r.caption for r in batch])
    served_wrong = score(reward, videos, ["a green square moving up on a red background"] * len(batch),
                         {"original_prompts": [r.text for r in batch]})
    from_facts = score(reward, videos, ["anything"] * len(batch), {"facts": [r.facts for r in batch]})
    for out in (under_caption, served_wrong, from_facts):
        assert torch.equal(out.total, under_request.total)
        assert all(torch.equal(out.terms[f], under_request.terms[f]) for f in FACTS)
    assert torch.equal(under_request.total, torch.ones(len(batch)))
    assert under_request.terms["background"][-2:].tolist() == [0.0, 0.0]  # not asked: not scored, total still 1

    colours = list(PALETTE)
    other = [Facts({"circle": "square", "square": "triangle", "triangle": "circle"}[r.facts.shape],
                   colours[(colours.index(r.facts.colour) + 2) % 6] if r.facts.colour else None,
                   colours[(colours.index(r.facts.background) + 2) % 6] if r.facts.background else None,
                   {"left": "up", "up": "right", "right": "down", "down": "left"}[r.facts.motion] if r.facts.motion
                   else None) for r in batch]
    others = torch.stack([video_of(f, Facts("circle", "green", "yellow", "up")) for f in other])
    low = score(reward, others, [r.text for r in batch])
    assert low.total.max() == 0.0, low.total
    assert score(IntentReward(total="all"), videos, [r.text for r in batch]).total.tolist() == [1.0] * len(batch)


def test_concern_terms_credit_each_refiner_with_its_own_facts(one_thread):
    """With concerns, term_of(refiner) is the mean of its concern's facts: a video with the right shape and
    motion but wrong colours scores refiner_0 and refiner_2 1, refiner_1 0; a request without motion gives
    the motion refiner 0 (no signal). Unknown concerns and experts named like facts are refused."""
    reward = IntentReward(concerns={"refiner_0": "shape", "refiner_1": "colours", "refiner_2": "motion"})
    asked = [Facts("triangle", "red", "blue", "down"), Facts("square", "cyan", "yellow", None)]
    videos = torch.stack([render("triangle", "green", "down", "yellow", 5, 32, 32),
                          render("square", "cyan", "left", "yellow", 5, 32, 32)])
    out = score(reward, videos, ["x", "y"], {"facts": asked})
    assert term_of(out, "refiner_0").tolist() == [1.0, 1.0]
    assert term_of(out, "refiner_1").tolist() == [0.0, 1.0]
    assert term_of(out, "refiner_2").tolist() == [1.0, 0.0]
    assert out.total.tolist() == pytest.approx([0.5, 1.0])
    with pytest.raises(ValueError, match=r"concerns \{'refiner_0': 'colour'\} unknown"):
        IntentReward(concerns={"refiner_0": "colour"})
    with pytest.raises(ValueError, match="fact terms' names"):
        IntentReward(concerns={"shape": "shape"})
    with pytest.raises(ValueError, match="asks for no shape, colour, background or motion"):
        score(reward, videos[:1], ["hello there"])


# ------------------------------------------------------------------------------------------------ refiner
@pytest.fixture(scope="module")
def refiner():
    """The shipped refiner, loaded as a card loads ``{arch: qwen2, pretrained: modules/assets/refiner}``."""
    return presets.build_model("qwen2", pretrained=presets.REFINER_ASSET).eval(), presets.build_tokenizer()


def test_accuracy_counts_asked_facts_only():
    """Rows: all asked and right; shape right, colour wrong, rest not asked; nothing asked (excluded)."""
    nan = float("nan")
    verdicts = {"shape": torch.tensor([1.0, 1.0, nan]), "colour": torch.tensor([1.0, 0.0, nan]),
                "background": torch.tensor([1.0, nan, nan]), "motion": torch.tensor([1.0, nan, nan])}
    assert accuracy(verdicts) == {"shape": 1.0, "colour": 0.5, "background": 1.0, "motion": 1.0, "all": 0.5, "n": 2}
    read = rewrite_verdicts(["a red circle moving left", "a blue square"], [Facts("circle", "red", None, "up")] * 2)
    assert read["shape"].tolist() == [1.0, 0.0] and read["motion"].tolist() == [0.0, 0.0]
    assert read["background"].isnan().all()
    colours = rewrite_verdicts(["red on blue"], [Facts("circle", "red", "cyan", "up")], "colours")
    assert colours["colour"].tolist() == [1.0] and colours["background"].tolist() == [0.0]
    assert colours["shape"].isnan().all()


def test_the_shipped_refiner_rewrites_seen_requests_well_but_not_perfectly(refiner, one_thread):
    """32 fixed train-split requests (seed 5). Measured when the asset was made (scripts/train_refiner.py):
    greedy all four 0.50 (shape 0.94, colour 0.77, background 0.70, motion 1.0), sampled at temperature 1
    (joint RL's) 0.53; the held-out split (same facts, held-out words and templates) 0.12; each concern on
    the train split: shape 0.94, colours 0.77 / 0.73, motion 1.0. Chance (a uniform guess of each fact)
    is 1/3, 1/6, 1/6, 1/4 and about 0.002 for all four. The thresholds sit well inside the gap between
    chance and perfect: every fact >= 0.6, all four between 0.3 and 0.8 (partly pretrained: RL has the
    train split's ambiguous colour words, unpretrained synonyms and template to teach), held-out at least
    0.2 below seen."""
    model, tokenizer = refiner
    seen = [RequestDataset(32, seed=5, split="train").request(i) for i in range(32)]
    held = [RequestDataset(32, seed=5, split="eval").request(i) for i in range(32)]
    texts, facts = [r.text for r in seen], [r.facts for r in seen]
    greedy = accuracy(rewrite_verdicts(refine(model, tokenizer, texts, REWRITE_TEMPLATE), facts))
    sampled = accuracy(rewrite_verdicts(refine(model, tokenizer, texts, REWRITE_TEMPLATE, temperature=1.0,
                                               generator=torch.Generator().manual_seed(0)), facts))
    held_out = accuracy(rewrite_verdicts(refine(model, tokenizer, [r.text for r in held]), [r.facts for r in held]))
    assert all(greedy[f] >= 0.6 for f in FACTS), greedy
    assert 0.3 <= greedy["all"] <= 0.8 and 0.3 <= sampled["all"] <= 0.8, (greedy, sampled)
    assert held_out["all"] <= greedy["all"] - 0.2, (held_out, greedy)
    for concern, fact_names in CONCERNS.items():
        part = accuracy(rewrite_verdicts(refine(model, tokenizer, texts, CONCERN_TEMPLATES[concern], max_new_tokens=24),
                                         facts, concern))
        assert all(part[f] >= 0.6 for f in fact_names), (concern, part)


@pytest.mark.slow
def test_the_shipped_refiner_is_unsure_of_the_ambiguous_colour_words(refiner, one_thread):
    """What prompt-only RL has to teach: a request whose shape colour is an ``AMBIGUOUS`` word (``teal``,
    ``amber``, …) is rewritten, sampled at temperature 1 (RL's rollouts), with the colour it names here in
    some samples and its near colour in others — both explored, neither certain (pretrained right 40% of
    the time) — while the same request in the world's own word is rewritten right nearly always."""
    model, tokenizer = refiner
    g = torch.Generator().manual_seed(0)

    def colours_written(word: str, background: str) -> list:
        text = f"a {word} circle moving left on a {background} background"
        return [parse_caption(r).colour for r in refine(model, tokenizer, [text] * 16, REWRITE_TEMPLATE,
                                                        temperature=1.0, generator=g)]

    right, near, plain = [], [], []
    for word, (colour, other) in AMBIGUOUS.items():
        background = next(c for c in ("blue", "green", "yellow") if c not in (colour, other))
        written = colours_written(word, background)
        right.append(written.count(colour) / 16)
        near.append(written.count(other) / 16)
        plain.append(colours_written(colour, background).count(colour) / 16)
    assert min(plain) >= 0.8, plain
    assert 0.1 <= sum(right) / len(right) <= 0.7 and sum(near) / len(near) >= 0.2, (right, near)
    assert sum(r + n >= 0.6 for r, n in zip(right, near)) >= 4, (right, near)  # mostly one of the two


def test_a_card_serves_the_shipped_refiner_as_a_qwen2_expert():
    """``{arch: qwen2, pretrained: REFINER_ASSET}`` builds the shipped weights for every refiner of a card
    (a plain ``arch: qwen2`` stays the random tiny preset), small enough to ship (< 1 MB)."""
    from posttrain.modules.models.cards import Expert, ModelCard

    card = ModelCard({}, num_refiners=2, refiner=Expert(arch="qwen2", pretrained=presets.REFINER_ASSET))
    card.build()
    shipped = presets.build_model("qwen2", pretrained=presets.REFINER_ASSET)
    for name in ("refiner_0", "refiner_1"):
        assert type(card[name]).__name__ == "Qwen2ForCausalLM"
        assert all(torch.equal(a, b) for a, b in zip(card[name].state_dict().values(), shipped.state_dict().values()))
    assert not torch.equal(next(presets.build_model("qwen2").parameters()), next(shipped.parameters()))
    assert os.path.getsize(os.path.join(presets.REFINER_ASSET, "model.safetensors")) < 1_000_000
