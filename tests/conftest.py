"""Shared test set-up: offline W&B and hub, tiny cards of real model classes."""
from __future__ import annotations

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `pytest -n 2` (the README's command): two workers share the 2 cores, one intra-op thread each — here and in
    # the `posttrain` processes a test starts (they inherit it). Tiny tensors gain nothing from a second thread.
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

from posttrain.modules.models.cards import Expert, ModelCard


def adamw(lr: float = 1e-3, **kwargs):
    return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.0, **kwargs)


# A random 0.15M-parameter Wan generator for the method tests (any preset override gives random
# weights): they measure learning against a control from scratch, fast. The pretrained world's
# generator (``wan_t2v`` without overrides) is tested in test_world.py.
TINY_WAN = {"num_attention_heads": 2, "ffn_dim": 128, "num_layers": 2}


def wan_card(lr: float = 1e-3, extra: dict[str, Expert] | None = None, **card_kwargs) -> ModelCard:
    """the pretrained world's text encoder and VAE (frozen) + a trainable tiny random Wan transformer."""
    experts = {
        "text_encoder": Expert(arch="umt5"),
        "vae": Expert(arch="wan_vae"),
        "transformer": Expert(arch="wan_t2v", preset=TINY_WAN, trainable=True, optimizer=adamw(lr)),
    }
    experts.update(extra or {})
    return ModelCard(experts=experts, text_max_length=32, **card_kwargs)


def flux_card(lr: float = 1e-3, transformer_preset: dict | None = None, **card_kwargs) -> ModelCard:
    """FLUX text-to-image: CLIP (pooled) + T5 text encoders and the image VAE (frozen) + trainable FLUX."""
    experts = {
        "text_encoder": Expert(arch="clip"),
        "text_encoder_2": Expert(arch="t5"),
        "vae": Expert(arch="vae_kl"),
        "transformer": Expert(arch="flux", trainable=True, optimizer=adamw(lr), preset=dict(transformer_preset or {})),
    }
    return ModelCard(experts=experts, text_max_length=32, **card_kwargs)


def i2v_card(lr: float = 1e-3, **card_kwargs) -> ModelCard:
    """Wan image-to-video (Wan 2.2 layout, no image encoder): UMT5 + Wan VAE (frozen) + trainable transformer."""
    experts = {
        "text_encoder": Expert(arch="umt5"),
        "vae": Expert(arch="wan_vae"),
        "transformer": Expert(arch="wan_i2v", trainable=True, optimizer=adamw(lr)),
    }
    return ModelCard(experts=experts, text_max_length=32, **card_kwargs)


def workflow_experts(t2i_trainable: bool = True, i2v_trainable: bool = True, lr: float = 1e-3,
                     drop: tuple[str, ...] = ()) -> dict[str, Expert]:
    """A FLUX text-to-image stage ``t2i_*`` and a Wan image-to-video stage ``i2v_*`` on one card."""
    def generator(arch: str, trainable: bool) -> Expert:
        return Expert(arch=arch, trainable=trainable, optimizer=adamw(lr) if trainable else None)

    experts = {
        "t2i_text_encoder": Expert(arch="clip"), "t2i_text_encoder_2": Expert(arch="t5"),
        "t2i_vae": Expert(arch="vae_kl"), "t2i_transformer": generator("flux", t2i_trainable),
        "i2v_text_encoder": Expert(arch="umt5"), "i2v_vae": Expert(arch="wan_vae"),
        "i2v_transformer": generator("wan_i2v", i2v_trainable),
    }
    return {name: expert for name, expert in experts.items() if name not in drop}


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


@pytest.fixture(scope="module")
def one_process():
    """ShardedExpertsStrategy of one process in this pytest process (gloo); the group, which DeepSpeed caches, lives
    until the end of the module, then it is torn down and the launch variables Lightning set for its one process
    (MASTER_PORT and kin) are given back: a later ``posttrain fit`` of this worker would inherit them and bind a
    port the group held."""
    from posttrain.lit.engine.strategy import ShardedExpertsStrategy
    from tests.helpers_strategy import LAUNCH_VARIABLES, close_process_group

    before = {variable: os.environ.get(variable) for variable in LAUNCH_VARIABLES}
    yield lambda: ShardedExpertsStrategy(process_group_backend="gloo")
    for variable, value in before.items():
        if value is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = value
    close_process_group()


def pytest_addoption(parser):
    parser.addoption("--kills", type=int, default=None,
                     help="tests/test_kill_anywhere.py: kill moments per config (default: the CI set of 3)")


@pytest.fixture(autouse=True)
def _own_wandb_service(monkeypatch):
    """Every `posttrain` subprocess a test starts runs its own W&B service. A test that ran W&B in this process
    left ``WANDB_SERVICE`` in the environment, and a child inheriting it joins this process's service; a child
    killed there (the kill-anywhere tests) leaves its run's stream registered, and its resume is refused "run ID ...
    is in use" — what failed once in CI when tests/test_evaluation.py began running W&B in-process before them."""
    monkeypatch.delenv("WANDB_SERVICE", raising=False)
    yield
