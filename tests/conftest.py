"""Shared test set-up: offline W&B and hub, tiny cards of real model classes."""
from __future__ import annotations

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from posttrain.modules.cards import Expert, ModelCard


def adamw(lr: float = 1e-3, **kwargs):
    return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.0, **kwargs)


def wan_card(lr: float = 1e-3, extra: dict[str, Expert] | None = None, **card_kwargs) -> ModelCard:
    """text encoder + VAE (frozen) + trainable Wan transformer, all tiny presets."""
    experts = {
        "text_encoder": Expert(arch="umt5"),
        "vae": Expert(arch="wan_vae"),
        "transformer": Expert(arch="wan_t2v", trainable=True, optimizer=adamw(lr)),
    }
    experts.update(extra or {})
    return ModelCard(experts=experts, text_max_length=32, **card_kwargs)


@pytest.fixture
def tiny_card() -> ModelCard:
    card = wan_card()
    card.build()
    return card


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors on 2 shared cores: a second intra-op thread only adds spin-waits (up to 10x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_addoption(parser):
    parser.addoption("--kills", type=int, default=None,
                     help="tests/test_kill_anywhere.py: kill moments per config (default: the CI set of 3)")
