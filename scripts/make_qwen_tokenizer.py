"""Writes modules/assets/qwen_image_tokenizer: a ``Qwen2Tokenizer`` (byte-level BPE, Qwen2's pre-tokenizer) small
enough for the tiny Qwen2.5-VL text encoder, that splits QwenImagePipeline's prompt template as Qwen2.5's own
tokenizer does, so that the pipeline's 34 dropped tokens are exactly the template's system turn.

Its vocabulary: the 256 byte symbols, each word of the template built up by merges (left to right), then Qwen's
``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``. Nothing is downloaded.

    python scripts/make_qwen_tokenizer.py
"""
from __future__ import annotations

import re

from tokenizers import pre_tokenizers
from transformers import Qwen2Tokenizer

from posttrain.modules.models.generators.qwen_image import PROMPT_TEMPLATE, TOKENIZER_ASSET

SPECIAL = ("<|im_start|>", "<|im_end|>")


def template_tokenizer() -> Qwen2Tokenizer:
    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    split = Qwen2Tokenizer(vocab=dict(vocab), merges=[])._tokenizer.pre_tokenizer  # Qwen2's regex, byte-level
    words = []
    for part in re.split("(" + "|".join(map(re.escape, SPECIAL)) + ")", PROMPT_TEMPLATE.replace("{}", "")):
        if part and part not in SPECIAL:
            words += [word for word, _ in split.pre_tokenize_str(part)]
    merges: list[tuple[str, str]] = []
    for word in words:  # each word merged symbol by symbol, left to right
        built = word[0]
        for symbol in word[1:]:
            if (built, symbol) not in merges:
                merges.append((built, symbol))
            built += symbol
            vocab.setdefault(built, len(vocab))
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)  # <|endoftext|>: unk, eos and pad, after the vocabulary
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL)})
    return tokenizer


if __name__ == "__main__":
    tokenizer = template_tokenizer()
    tokenizer.save_pretrained(TOKENIZER_ASSET)
    print(f"{len(tokenizer)} tokens -> {TOKENIZER_ASSET}")
