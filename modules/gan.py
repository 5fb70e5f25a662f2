"""DMD2's GAN term: a small classifier on the critic's (fake score net's) intermediate features.

Yin et al. 2024, "Improved Distribution Matching Distillation for Fast Image Synthesis", §4.2 and reference
``tianweiy/DMD2`` ``main/sd_guidance.py`` (``cls_pred_branch`` on the fake UNet's bottleneck,
``compute_cls_logits`` with ``diffusion_gan``: both real and generated samples are noised at a random timestep
before the fake score net reads them). The critic and its head learn to tell teacher samples (real) from student
samples (fake); the student gets the non-saturating generator loss through the frozen critic
(``modules/losses.py``: ``gan_critic_loss``, ``gan_generator_loss``).

Here the features are the hidden states after the critic's last transformer block, ``(B, N, D)`` tokens; the head
scores every token and averages the logits (a patch discriminator over space-time tokens, which after attention
each see the whole clip, motion included). The head is a submodule of the critic (``attach_head``), so it steps
with the critic's optimizer, lives in the critic's checkpoint entry and resumes with it, as in the reference
(``cls_pred_branch`` belongs to the guidance model and its optimizer).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

HEAD = "gan_head"  # the head's attribute on the critic: its state dict keys start with "gan_head."


class FeatureClassifier(nn.Module):
    """(B, N, D) token features -> (B,) realism logits: LayerNorm, a two-layer MLP per token, mean over tokens."""

    def __init__(self, dim: int, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.SiLU(), nn.Linear(hidden, 1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features.float()).squeeze(-1).mean(dim=1)


def feature_dim(transformer: nn.Module) -> int:
    """Width of the hidden states after a Wan transformer block (heads × head dim)."""
    config = transformer.config
    return int(config.num_attention_heads * config.attention_head_dim)


def attach_head(critic: nn.Module, seed: int, hidden: int = 64) -> FeatureClassifier:
    """Give ``critic`` (a Wan transformer: ``blocks``) its GAN head, initialised from ``seed`` without touching the
    global RNG (the run's other draws stay where they were). Returns the head."""
    if not hasattr(critic, "blocks"):
        raise ValueError(f"the GAN head reads the critic's transformer blocks; {type(critic).__name__} has no "
                         f"`blocks` (use a Wan critic, or set gan_critic_weight and gan_generator_weight to 0)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = FeatureClassifier(feature_dim(critic), hidden)
    first = next(critic.parameters())
    critic.add_module(HEAD, head.to(device=first.device))
    return head


@contextlib.contextmanager
def block_features(transformer: nn.Module, index: int = -1) -> Iterator[list[torch.Tensor]]:
    """Collect the output hidden states (B, N, D) of ``transformer.blocks[index]`` of every forward run inside the
    context (a forward hook; the transformer's output is unchanged)."""
    found: list[torch.Tensor] = []
    handle = transformer.blocks[index].register_forward_hook(lambda _module, _args, output: found.append(output))
    try:
        yield found
    finally:
        handle.remove()


@contextlib.contextmanager
def frozen(module: nn.Module) -> Iterator[None]:
    """Run ``module`` as a constant: its parameters stop requiring grad inside the context, so a loss through it
    reaches its inputs only (the student's GAN loss through the critic, DMD2's ``requires_grad_(False)``)."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)
