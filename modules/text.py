"""Text encoding for the generator's conditioning, as the Wan pipeline does it."""
from __future__ import annotations

import torch


def embed_prompts(tokenizer, encoder: torch.nn.Module, prompts: list[str], max_length: int) -> torch.Tensor:
    """(B, max_length, D) last hidden states with padding positions zeroed (diffusers' WanPipeline),
    with gradient: what training the encoder together with the generator backs up through."""
    tokens = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True,
                       return_tensors="pt")
    device = next(encoder.parameters()).device
    ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
    hidden = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    return (hidden * mask.unsqueeze(-1).to(hidden.dtype)).float()


@torch.no_grad()
def encode_prompts(tokenizer, encoder: torch.nn.Module, prompts: list[str], max_length: int) -> torch.Tensor:
    """``embed_prompts`` of a frozen encoder (no gradient)."""
    return embed_prompts(tokenizer, encoder, prompts, max_length)
