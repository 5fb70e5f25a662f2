"""Prompt refiners: a causal LM samples a refinement of each prompt, with token log-probabilities.

The refiner policy is the LM's next-token distribution restricted to the tokens that decode, alone, to
printable text (``refiner_vocab``), plus EOS, at a temperature. Each such token is whole UTF-8
characters, so the decoded text is exactly the tokens trained on (a partial byte sequence would decode to
nothing or a replacement character: the reward would score other text than the policy emitted). For the
embedded ``ByT5Tokenizer`` these are the printable ASCII bytes (0x20…0x7E, ids 35…129, id = byte + 3); for
a real LM's tokenizer (e.g. Qwen2's byte-level BPE) they are computed once from its vocabulary. A random
tiny LM then still emits valid text, and the sampled
log-probabilities and their recompute with gradient see the *same* distribution. The LM is prompted
chat-free: the context is ``template.format(prompt=...)`` (default ``"{prompt}\\n"``), left-padded to
the longest prompt of the batch; the completion ends at the first EOS (kept, it is an action) and is
padded after it.

Losses (docs/methods.md#joint-rl; UniRL / PromptRL):
- token policy gradient ``-(A·exp(lp - sg(lp)))`` averaged over a completion's tokens: its value is
  ``-A`` and its gradient ``-A·∇lp``, REINFORCE with the group advantage A of the sample;
- k3 KL to the frozen reference ``exp(ref - lp) - (ref - lp) - 1`` (Schulman's unbiased, non-negative
  estimator of KL(π‖π_ref) from samples of π), averaged over the same tokens.
Everything random takes a ``torch.Generator`` (``rng``) so a resumed run samples the same refinements.
``refiner_loss`` is a refiner's update (the two losses on one rollout) and ``refiner_logprob_gap`` its log-probability parity check,
shared by joint_rl and workflow_rl.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional

import torch

PAD_ID, EOS_ID = 0, 1  # ByT5's
DEFAULT_TEMPLATE = "{prompt}\n"


@dataclass
class Refinements:
    """A batch of sampled refinements. ``T`` = the longest completion of the batch (≤ max_new_tokens)."""

    texts: list[str]
    tokens: torch.Tensor  # (B, T) long, PAD after EOS
    mask: torch.Tensor  # (B, T) bool, completion tokens including the EOS that ends one
    log_probs: torch.Tensor  # (B, T) float32 log π(token) at sampling time, 0 where ~mask
    context_ids: torch.Tensor  # (B, L) long, left-padded
    context_mask: torch.Tensor  # (B, L) long, 0 on left padding
    vocab: "RefinerVocab"  # what the policy could emit (the recompute uses the same restriction)

    def select(self, index: torch.Tensor) -> "Refinements":
        """The rows ``index`` (a (M,) long tensor)."""
        rows = index.tolist()
        return Refinements([self.texts[i] for i in rows], self.tokens[index], self.mask[index],
                           self.log_probs[index], self.context_ids[index], self.context_mask[index], self.vocab)


@dataclass(frozen=True)
class RefinerVocab:
    """What a refiner may emit: ``allowed`` (V,) bool over the LM's output vocabulary, and its EOS and pad ids."""

    allowed: torch.Tensor
    eos_id: int
    pad_id: int


_VOCABS: dict[tuple[int, int], RefinerVocab] = {}


def refiner_vocab(tokenizer, vocab_size: int) -> RefinerVocab:
    """The tokens of ``tokenizer`` that decode alone to non-empty printable text (no special token, no
    partial UTF-8 byte sequence, no control character), plus EOS; computed once per tokenizer."""
    key = (id(tokenizer), vocab_size)
    if key not in _VOCABS:
        eos_id = tokenizer.eos_token_id
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
        if eos_id is None or not 0 <= eos_id < vocab_size:
            raise ValueError(f"refiner tokenizer {type(tokenizer).__name__}: eos_token_id={eos_id} must lie in the "
                             f"LM's vocabulary [0, {vocab_size}); give the LM's own tokenizer folder")
        special = set(tokenizer.all_special_ids)
        n = min(vocab_size, len(tokenizer))
        texts = tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False)
        allowed = torch.zeros(vocab_size, dtype=torch.bool)
        for i, text in enumerate(texts):
            allowed[i] = i not in special and bool(text) and "\ufffd" not in text and text.isprintable()
        allowed[eos_id] = True
        _VOCABS[key] = RefinerVocab(allowed, int(eos_id), int(pad_id))
    return _VOCABS[key]


def restricted(vocab: RefinerVocab, allowed_ids: list[int]) -> RefinerVocab:
    """``vocab`` with only ``allowed_ids`` (and EOS) allowed (tests and constrained refiners)."""
    allowed = torch.zeros_like(vocab.allowed)
    allowed[allowed_ids] = True
    allowed[vocab.eos_id] = True
    return RefinerVocab(allowed, vocab.eos_id, vocab.pad_id)


def encode_contexts(tokenizer, prompts: list[str], template: str = DEFAULT_TEMPLATE,
                    pad_id: int = PAD_ID) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) left-padded context ids and their (B, L) attention mask; no EOS is appended."""
    if not prompts:
        raise ValueError("no prompts to refine")
    rows = [tokenizer(template.format(prompt=p), add_special_tokens=False).input_ids for p in prompts]
    length = max(len(r) for r in rows)
    if length == 0:
        raise ValueError(f"template {template!r} with prompts {prompts!r} gives empty contexts")
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, length - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, length - len(row):] = 1
    return ids, mask


def _policy_log_probs(logits: torch.Tensor, allowed: torch.Tensor, temperature: float) -> torch.Tensor:
    """log-softmax of the logits restricted to ``allowed`` tokens, at ``temperature``; float32."""
    logits = logits.float().masked_fill(~allowed.to(logits.device), float("-inf"))
    return torch.log_softmax(logits / temperature, dim=-1)


def _forward_log_probs(model: torch.nn.Module, ids: torch.Tensor, attention_mask: torch.Tensor,
                       allowed: torch.Tensor, temperature: float, positions: slice) -> torch.Tensor:
    """(B, P, V) policy log-probs of the next token after each position in ``positions``."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits
    return _policy_log_probs(logits[:, positions], allowed, temperature)


@torch.no_grad()
def sample_refinements(model: torch.nn.Module, tokenizer, prompts: list[str], rng: torch.Generator,
                       max_new_tokens: int = 8, temperature: float = 1.0, template: str = DEFAULT_TEMPLATE,
                       vocab: Optional[RefinerVocab] = None) -> Refinements:
    """Sample one refinement per prompt, capturing each token's log-probability.

    A loop over the real LM's forward with its KV cache: the context once, then one token per step.
    Recomputing with ``completion_log_probs`` (one forward, no cache) reproduces the captured
    log-probs to float error (the LM's log-probability parity). Stops when every row has emitted EOS.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    device = next(model.parameters()).device
    vocab = vocab or refiner_vocab(tokenizer, model.get_output_embeddings().weight.shape[0])
    allowed, eos_id, pad_id = vocab.allowed.to(device), vocab.eos_id, vocab.pad_id
    context_ids, context_mask = encode_contexts(tokenizer, prompts, template, pad_id)
    step_ids, attn = context_ids.to(device), context_mask.to(device)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = None
    batch = len(prompts)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    tokens, masks, log_probs = [], [], []
    for _ in range(max_new_tokens):
        # 1. next-token policy at the last position (left padding puts every row's last token there)
        position_ids = (attn.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
        out = model(input_ids=step_ids, attention_mask=attn, position_ids=position_ids, use_cache=True,
                    **{cache_kw: cache})
        cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        lp = _policy_log_probs(out.logits[:, -1], allowed, temperature)  # (B, V)
        # 2. sample from it with the caller's rng (on its device), keep the token's log-prob
        token = torch.multinomial(lp.exp().to(rng.device), 1, generator=rng).to(device)[:, 0]
        token_lp = lp.gather(1, token[:, None])[:, 0]
        live = ~done
        token = torch.where(live, token, torch.full_like(token, pad_id))
        tokens.append(token)
        masks.append(live)
        log_probs.append(torch.where(live, token_lp, torch.zeros_like(token_lp)))
        # 3. rows that emitted EOS are done; later tokens are padding outside the mask
        done = done | (token == eos_id)
        step_ids = token[:, None]
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
        if bool(done.all()):
            break
    tokens_t = torch.stack(tokens, dim=1)
    mask_t = torch.stack(masks, dim=1)
    texts = [decode_completion(tokenizer, row, eos_id) for row in tokens_t.tolist()]
    return Refinements(texts, tokens_t, mask_t, torch.stack(log_probs, dim=1).float(),
                       context_ids.to(device), context_mask.to(device), vocab)


def decode_completion(tokenizer, token_ids: list[int], eos_id: int = EOS_ID) -> str:
    """Text of a completion up to (not including) its first EOS (whole characters: nothing is dropped)."""
    if eos_id in token_ids:
        token_ids = token_ids[: token_ids.index(eos_id)]
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def completion_log_probs(model: torch.nn.Module, refinements: Refinements, temperature: float = 1.0) -> torch.Tensor:
    """(B, T) log π(token) of the stored completions under ``model``'s current weights, with grad.

    One forward over context + completion; 0 outside ``refinements.mask``. At the sampling weights it
    reproduces ``refinements.log_probs``.
    """
    allowed = refinements.vocab.allowed
    length, steps = refinements.context_ids.shape[1], refinements.tokens.shape[1]
    ids = torch.cat([refinements.context_ids, refinements.tokens], dim=1)
    attn = torch.cat([refinements.context_mask, torch.ones_like(refinements.tokens)], dim=1)
    # the logits at position L-1+t predict completion token t
    lp = _forward_log_probs(model, ids, attn, allowed, temperature, slice(length - 1, length - 1 + steps))
    token_lp = lp.gather(2, refinements.tokens[..., None])[..., 0]
    return token_lp.masked_fill(~refinements.mask, 0.0)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) mean of ``values`` (B, T) over each row's ``mask``; 0 for an empty row."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


def token_pg_loss(log_probs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-sample token policy gradient ``mean_t -(A·exp(lp_t - sg(lp_t)))`` over the completion tokens.

    Args:
        log_probs: (B, T) log π_θ(token) with grad.
        advantages: (B,) one advantage per completion.
        mask: (B, T) bool, completion tokens (padding after EOS excluded).
    Returns (B,) losses (value -A where a row has tokens) and metrics.
    """
    if log_probs.shape != mask.shape or advantages.shape != log_probs.shape[:1]:
        raise ValueError(f"token_pg_loss: log_probs {tuple(log_probs.shape)}, mask {tuple(mask.shape)} and "
                         f"advantages {tuple(advantages.shape)} must be (B, T), (B, T), (B,)")
    ratio = torch.exp(log_probs - log_probs.detach())  # 1 in value, ∇ = ∇lp
    per_token = -advantages[:, None].to(log_probs.dtype) * ratio
    per_sample = _masked_mean(per_token, mask)
    tokens = mask.sum(dim=1).float()
    return per_sample, {"tokens": tokens.mean().detach(),
                        "log_prob": (_masked_mean(log_probs, mask).detach()).mean()}


def k3_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor,
          mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-sample k3 KL ``mean_t [exp(ref - lp) - (ref - lp) - 1]`` over the completion tokens (≥ 0).

    ``log_probs`` (B, T) carries grad, ``ref_log_probs`` (B, T) comes from the frozen reference.
    """
    if log_probs.shape != ref_log_probs.shape or log_probs.shape != mask.shape:
        raise ValueError(f"k3_kl: log_probs {tuple(log_probs.shape)}, ref_log_probs "
                         f"{tuple(ref_log_probs.shape)} and mask {tuple(mask.shape)} must all be (B, T)")
    delta = (ref_log_probs.detach() - log_probs).masked_fill(~mask, 0.0)
    per_token = torch.exp(delta) - delta - 1
    per_sample = _masked_mean(per_token, mask)
    return per_sample, {"kl": per_sample.mean().detach()}


def refiner_loss(card, name: str, reference: str, sample: Refinements, advantages: torch.Tensor,
                 temperature: float, kl_weight: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Refiner ``name``'s update loss on its rollout ``sample``: the batch mean of the token policy gradient
    credited with ``advantages`` (B,) plus ``kl_weight`` × the batch mean of the k3 KL to its frozen
    ``reference`` (a LoRA's: the refiner with its adapter off), and the metrics ``kl`` and ``tokens``.
    ``card`` holds both; the refiner's forward carries grad, the reference's none."""
    log_probs = completion_log_probs(card[name], sample, temperature)  # (B, T), grad
    with torch.no_grad(), card.use(reference) as frozen:
        ref_log_probs = completion_log_probs(frozen, sample, temperature)
    pg, pg_metrics = token_pg_loss(log_probs, advantages, sample.mask)
    kl, _ = k3_kl(log_probs, ref_log_probs, sample.mask)
    return pg.mean() + kl_weight * kl.mean(), {"kl": kl.detach().mean(), "tokens": pg_metrics["tokens"]}


@torch.no_grad()
def refiner_logprob_gap(model: torch.nn.Module, sample: Refinements, temperature: float) -> torch.Tensor:
    """max |recomputed − captured token log p| of ``sample`` under ``model``'s current weights: ~0 at the
    weights it was sampled with (the LM's log-probability parity)."""
    return (completion_log_probs(model, sample, temperature) - sample.log_probs).abs().max()


def compose_prompt(prompt: str, refinements: list[str], separator: str = ", ") -> str:
    """The generator prompt: the original prompt, then each non-empty refinement in refiner order."""
    parts = [prompt] + [r.strip() for r in refinements if r.strip()]
    return separator.join(parts)


def target_probability(model: torch.nn.Module, tokenizer, prompts: list[str], token_ids: int | list[int],
                       temperature: float = 1.0, template: str = DEFAULT_TEMPLATE) -> torch.Tensor:
    """(B,) policy probability that the first refinement token of each prompt is one of ``token_ids``."""
    vocab = refiner_vocab(tokenizer, model.get_output_embeddings().weight.shape[0])
    allowed = vocab.allowed
    ids, attn = encode_contexts(tokenizer, prompts, template, vocab.pad_id)
    device = next(model.parameters()).device
    with torch.no_grad():
        lp = _forward_log_probs(model, ids.to(device), attn.to(device), allowed, temperature, slice(-1, None))
    token_ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
    return lp[:, 0, token_ids].exp().sum(dim=-1)
