"""Refiner LM sampling and losses (modules/models/refiners.py) on the real tiny Qwen2 preset."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from posttrain.modules.models.presets import build_model, build_tokenizer
from posttrain.modules.models.refiners import (
    EOS_ID,
    PAD_ID,
    Refinements,
    completion_log_probs,
    compose_prompt,
    encode_contexts,
    k3_kl,
    refiner_vocab,
    restricted,
    sample_refinements,
    target_probability,
    token_pg_loss,
)

PROMPTS = ["a red circle moving left on a blue background", "a cat", "x"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    return build_model("qwen2").eval(), build_tokenizer()


def test_token_pg_loss_hand_derived():
    """Rows: lp = [-1, -2, pad], A = 2 and lp = [-0.5, pad, pad], A = -1.

    exp(lp - sg(lp)) = 1, so the value per token is -A: row 0 mean(-2, -2) = -2, row 1 = 1.
    d/d lp_t = -A / n_tokens: row 0 -> -1, -1, 0 (pad); row 1 -> +1, 0, 0.
    """
    lp = torch.tensor([[-1.0, -2.0, -7.0], [-0.5, -3.0, -4.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    per_sample, metrics = token_pg_loss(lp, torch.tensor([2.0, -1.0]), mask)
    assert torch.allclose(per_sample, torch.tensor([-2.0, 1.0]))
    per_sample.sum().backward()
    assert torch.allclose(lp.grad, torch.tensor([[-1.0, -1.0, 0.0], [1.0, 0.0, 0.0]]))
    assert metrics["tokens"].item() == 1.5


def test_k3_kl_hand_derived():
    """lp = log 0.5, ref = log 0.25: d = ref - lp = log 0.5; k3 = 0.5 - log 0.5 - 1 = 0.19315.

    d k3 / d lp = 1 - exp(d) = 0.5, divided by the row's 2 tokens -> 0.25; equal lp and ref give 0.
    """
    lp = torch.tensor([[math.log(0.5), math.log(0.5)], [math.log(0.3), 0.0]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(0.25)], [math.log(0.3), -9.0]])
    mask = torch.tensor([[True, True], [True, False]])
    per_sample, _ = k3_kl(lp, ref, mask)
    expected = 0.5 - math.log(0.5) - 1
    assert torch.allclose(per_sample, torch.tensor([expected, 0.0]), atol=1e-6)
    per_sample.sum().backward()
    assert torch.allclose(lp.grad, torch.tensor([[0.25, 0.25], [0.0, 0.0]]), atol=1e-6)


def test_loss_shape_errors():
    with pytest.raises(ValueError, match=r"token_pg_loss: log_probs \(2, 3\)"):
        token_pg_loss(torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="k3_kl"):
        k3_kl(torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3, dtype=torch.bool))


def test_compose_prompt_in_order_skipping_empty():
    assert compose_prompt("a red circle", ["bright", "", " slow "]) == "a red circle, bright, slow"
    assert compose_prompt("a red circle", []) == "a red circle"


def test_allowed_tokens_are_printable_ascii_and_eos():
    """From ByT5's vocabulary: the 95 printable ASCII bytes (0x20…0x7E, ids 35…129) and EOS; no control byte,
    no byte above 0x7F (alone it is a partial UTF-8 sequence), no special or extra id."""
    allowed = refiner_vocab(build_tokenizer(), 384).allowed
    assert allowed.sum().item() == 95 + 1
    assert allowed[EOS_ID] and allowed[3 + ord(" ")] and allowed[3 + ord("~")]
    assert not allowed[PAD_ID] and not allowed[2] and not allowed[3 + ord("\n")] and not allowed[3 + 0x80]
    assert not allowed[259:].any()
    with pytest.raises(ValueError, match="eos_token_id=1 must lie in the LM's vocabulary"):
        refiner_vocab(build_tokenizer(), 1)


def test_a_byte_level_bpe_vocabulary_keeps_whole_characters(tmp_path):
    """A real LM's byte-level BPE tokenizer (trained here on a few strings, as Qwen2's is built): allowed are
    the tokens that decode alone to printable text; a token holding half of a multi-byte character is not."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["a red circle moving left", "é ü 你好"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    vocab = refiner_vocab(tok, len(tok))
    texts = tok.batch_decode([[i] for i in range(len(tok))])
    assert vocab.allowed[vocab.eos_id] and vocab.pad_id == vocab.eos_id
    assert all(texts[i].isprintable() and "\ufffd" not in texts[i] for i in range(len(tok))
               if vocab.allowed[i] and i != vocab.eos_id)
    partial = [i for i, text in enumerate(texts) if "\ufffd" in text]
    assert partial and not vocab.allowed[partial].any()  # lone bytes of é, ü, 你 are never emitted


def test_contexts_are_left_padded():
    ids, mask = encode_contexts(build_tokenizer(), ["ab", "a"], template="{prompt}")
    assert ids.tolist() == [[3 + ord("a"), 3 + ord("b")], [PAD_ID, 3 + ord("a")]]
    assert mask.tolist() == [[1, 1], [0, 1]]
    with pytest.raises(ValueError, match="no prompts"):
        encode_contexts(build_tokenizer(), [])


def test_sampling_emits_only_bytes_and_is_seeded(lm):
    """The random LM gives ~1/3 of its mass to special and extra ids: unmasked, 128 draws would hit them."""
    model, tok = lm
    a = sample_refinements(model, tok, PROMPTS * 4, torch.Generator().manual_seed(1), max_new_tokens=16)
    b = sample_refinements(model, tok, PROMPTS * 4, torch.Generator().manual_seed(1), max_new_tokens=16)
    c = sample_refinements(model, tok, PROMPTS * 4, torch.Generator().manual_seed(2), max_new_tokens=16)
    emitted = a.tokens[a.mask]
    assert emitted.numel() > 100
    assert refiner_vocab(tok, 384).allowed[emitted].all()
    assert torch.equal(a.tokens, b.tokens) and a.texts == b.texts
    assert not torch.equal(a.tokens, c.tokens)
    # the decoded text is exactly the tokens trained on: it re-encodes to them (nothing dropped)
    for text, tokens, mask in zip(a.texts, a.tokens.tolist(), a.mask.tolist()):
        emitted_row = [t for t, m in zip(tokens, mask) if m and t != EOS_ID]
        assert tok(text, add_special_tokens=False).input_ids == emitted_row


def test_eos_ends_a_completion_and_padding_is_masked(lm):
    """With bytes 3…4 allowed, EOS is one of three choices: most rows stop early."""
    model, tok = lm
    r = sample_refinements(model, tok, PROMPTS * 4, torch.Generator().manual_seed(0), max_new_tokens=8,
                           vocab=restricted(refiner_vocab(tok, 384), [3, 4]))
    stopped = 0
    for row_tokens, row_mask, row_lp in zip(r.tokens.tolist(), r.mask.tolist(), r.log_probs.tolist()):
        if EOS_ID in row_tokens:
            stopped += 1
            end = row_tokens.index(EOS_ID)
            assert row_mask == [True] * (end + 1) + [False] * (len(row_mask) - end - 1)
            assert all(t == PAD_ID for t in row_tokens[end + 1:])
            assert all(v == 0.0 for v in row_lp[end + 1:])
            assert all(v < 0.0 for v in row_lp[: end + 1])
    assert stopped >= 6
    assert all(set(text) <= {"\x00", "\x01"} for text in r.texts)


def test_recomputed_log_probs_equal_captured_padded_or_not(lm):
    """The LM's log-probability parity: one forward over context + completion reproduces the sampling log-probs,
    and left padding changes nothing (each row recomputed alone, unpadded)."""
    model, tok = lm
    r = sample_refinements(model, tok, PROMPTS, torch.Generator().manual_seed(3), max_new_tokens=8)
    assert (completion_log_probs(model, r) - r.log_probs).abs().max() < 1e-5
    for i in range(len(PROMPTS)):
        row = r.select(torch.tensor([i]))
        keep = row.context_mask[0].bool()
        alone = Refinements(row.texts, row.tokens, row.mask, row.log_probs, row.context_ids[:, keep],
                            row.context_mask[:, keep], row.vocab)
        assert (completion_log_probs(model, alone) - row.log_probs).abs().max() < 1e-5


def test_positive_advantage_raises_sampled_completion_and_kl_to_copy_is_zero(lm):
    model, tok = lm
    model = copy.deepcopy(model).train()
    reference = copy.deepcopy(model).eval()
    r = sample_refinements(model, tok, PROMPTS, torch.Generator().manual_seed(4), max_new_tokens=8)
    lp = completion_log_probs(model, r)
    kl, _ = k3_kl(lp, completion_log_probs(reference, r), r.mask)
    assert kl.abs().max() < 1e-6
    loss, _ = token_pg_loss(lp, torch.tensor([1.0, 1.0, -1.0]), r.mask)
    torch.optim.SGD(model.parameters(), lr=0.5).zero_grad()
    loss.mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
    after = completion_log_probs(model, r).detach()
    gain = ((after - r.log_probs) * r.mask).sum(1)
    assert gain[0] > 0 and gain[1] > 0 and gain[2] < 0


def test_target_probability_matches_first_token_policy(lm):
    model, tok = lm
    p = target_probability(model, tok, PROMPTS, 3 + ord("z"))
    assert p.shape == (3,) and (p > 0).all() and (p < 0.05).all()
    # the allowed tokens carry all the mass, the others none; the first sampled token follows p
    assert torch.allclose(target_probability(model, tok, PROMPTS, list(range(384))), torch.ones(3), atol=1e-5)
    assert target_probability(model, tok, PROMPTS, [0, 2, 259, 383]).max() == 0.0
    ascii_ids = [3 + c for c in range(128)]
    p_ascii = target_probability(model, tok, PROMPTS[:1], ascii_ids).item()
    r = sample_refinements(model, tok, PROMPTS[:1] * 400, torch.Generator().manual_seed(5), max_new_tokens=1)
    share = sum(t in ascii_ids for t in r.tokens[:, 0].tolist()) / 400
    assert abs(share - p_ascii) < 4 * math.sqrt(p_ascii * (1 - p_ascii) / 400)


def test_refiner_loss_and_logprob_gap_as_joint_and_workflow_rl_use_them():
    """``refiner_loss`` against a reference with the same weights: the k3 KL is 0, so the loss is the batch mean
    of the token policy gradient, -mean(A) = -(1 + 1 - 1)/3 when every row has tokens, and its gradient raises
    the log p of the rows with A > 0 (as ``token_pg_loss`` alone). ``refiner_logprob_gap`` is ~0 at the sampling
    weights, and not once the weights have moved."""
    from posttrain.modules.models.cards import Expert, ModelCard
    from posttrain.modules.models.refiners import refiner_logprob_gap, refiner_loss

    torch.manual_seed(0)
    card = ModelCard(experts={}, num_refiners=1,
                     refiner=Expert(arch="qwen2", trainable=True, optimizer=lambda p: torch.optim.SGD(p, lr=0.5)))
    card.build()
    reference = card.add_role("reference", of="refiner_0")
    model, tok = card["refiner_0"], card.tokenizers["refiner_0"]
    r = sample_refinements(model, tok, PROMPTS, torch.Generator().manual_seed(4), max_new_tokens=8)
    assert refiner_logprob_gap(model, r, 1.0) < 1e-5
    loss, metrics = refiner_loss(card, "refiner_0", reference, r, torch.tensor([1.0, 1.0, -1.0]), 1.0, 0.01)
    assert r.mask.any(dim=1).all() and loss.item() == pytest.approx(-1 / 3, abs=1e-6)
    assert metrics["kl"].item() < 1e-6 and metrics["tokens"].item() > 0
    loss.backward()
    with torch.no_grad():
        for p in card.parameters_of("refiner_0"):
            p -= 0.5 * p.grad
    after = completion_log_probs(model, r).detach()
    gain = ((after - r.log_probs) * r.mask).sum(1)
    assert gain[0] > 0 and gain[1] > 0 and gain[2] < 0
    assert refiner_logprob_gap(model, r, 1.0) > 1e-3
    assert refiner_logprob_gap(card[reference], r, 1.0) < 1e-5  # the frozen reference did not move
