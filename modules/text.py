"""Text encoding for the generator's conditioning, as the Wan pipeline does it."""
from __future__ import annotations

import torch


def tokenize(tokenizer, prompts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, max_length) token ids and attention mask, padded and truncated to ``max_length``."""
    tokens = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")
    return tokens.input_ids, tokens.attention_mask


def embed_tokens(encoder: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, L, D) last hidden states with padding positions zeroed (diffusers' WanPipeline), with gradient:
    what training the encoder together with the generator backs up through."""
    device = next(encoder.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    hidden = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    return (hidden * mask.unsqueeze(-1).to(hidden.dtype)).float()


def embed_prompts(tokenizer, encoder: torch.nn.Module, prompts: list[str], max_length: int) -> torch.Tensor:
    """``embed_tokens`` of ``prompts`` (with gradient)."""
    return embed_tokens(encoder, *tokenize(tokenizer, prompts, max_length))


@torch.no_grad()
def encode_prompts(tokenizer, encoder: torch.nn.Module, prompts: list[str], max_length: int) -> torch.Tensor:
    """``embed_prompts`` of a frozen encoder (no gradient)."""
    return embed_prompts(tokenizer, encoder, prompts, max_length)
