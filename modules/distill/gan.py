"""DMD2's GAN term: a small classifier on the critic's (fake score net's) intermediate features, or on the clips.

Yin et al. 2024, "Improved Distribution Matching Distillation for Fast Image Synthesis", §4.2 and reference
``tianweiy/DMD2`` ``main/sd_guidance.py`` (``cls_pred_branch`` on the fake UNet's bottleneck,
``compute_cls_logits`` with ``diffusion_gan``: both real and generated samples are noised at a random timestep
before the fake score net reads them). The critic and its head learn to tell teacher samples (real) from student
samples (fake); the student gets the non-saturating generator loss through the frozen critic
(``modules/flow/losses.py``: ``gan_critic_loss``, ``gan_generator_loss``).

Here the features are the hidden states after the critic's last transformer block, ``(B, N, D)`` tokens; the head
scores every token and averages the logits (a patch discriminator over space-time tokens, which after attention
each see the whole clip, motion included). With several blocks (``blocks``), each token's features from those
blocks are concatenated, ``(B, N, k·D)``, before the head reads them: a discriminator on several depths of the
critic, as LADD's (Sauer et al. 2024) heads read several layers of theirs.

On pixels instead (``space="pixels"``): a 3-D PatchGAN (``PixelDiscriminator``, Isola et al. 2017's patch
discriminator with a temporal kernel, spectrally normalized as Miyato et al. 2018, conditioned on the prompt by
projection) reads the VAE-decoded clips, real and the student's alike through the same decoder; the student's loss
reaches its latent through the frozen decoder. The critic's features sit on the transformer's patch grid (a few
tokens a frame here); the pixel head reads edges and corners at the clips' own resolution.

The head is a submodule of the critic (``attach_head``), so it steps with the critic's optimizer, lives in the
critic's checkpoint entry and resumes with it, as in the reference (``cls_pred_branch`` belongs to the guidance model
and its optimizer).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

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


class PixelDiscriminator(nn.Module):
    """(B, C, F, H, W) decoded clips and (B, T) their prompts' text summaries -> (B,) realism logits: three
    spectrally normalized 3-D convolutions, each halving height and width (kernel 3 in time, 4 in space), LeakyReLU
    between; a last convolution gives one logit per space-time patch, averaged, plus the projection term (Miyato &
    Koyama 2018): the pooled features' inner product with a linear embedding of the text, so a clip is judged as a
    sample of its prompt (a red square is no real sample of "a cyan triangle"). Every patch sees neighbouring frames,
    so motion is judged with shape."""

    def __init__(self, text_dim: int, channels: int = 3, width: int = 32):
        super().__init__()
        norm = nn.utils.parametrizations.spectral_norm
        layers: list[nn.Module] = []
        for cin, cout in [(channels, width), (width, 2 * width), (2 * width, 2 * width)]:
            layers += [norm(nn.Conv3d(cin, cout, (3, 4, 4), stride=(1, 2, 2), padding=1)), nn.LeakyReLU(0.2)]
        self.net = nn.Sequential(*layers)
        self.out = norm(nn.Conv3d(2 * width, 1, 3, padding=1))
        self.embed = norm(nn.Linear(text_dim, 2 * width))

    def forward(self, video: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        features = self.net(video.float())
        projection = (features.mean(dim=(2, 3, 4)) * self.embed(text.float())).sum(dim=1)
        return self.out(features).flatten(1).mean(dim=1) + projection


def pooled_text(hidden: torch.Tensor) -> torch.Tensor:
    """(B, L, D) text hidden states, zero past each prompt's tokens (as Wan pipelines pad them) -> (B, D) the mean
    over each prompt's own tokens."""
    kept = (hidden.abs().sum(dim=-1, keepdim=True) > 0).to(hidden.dtype)
    return (hidden * kept).sum(dim=1) / kept.sum(dim=1).clamp(min=1)


def feature_dim(transformer: nn.Module) -> int:
    """Width of the hidden states after a Wan transformer block (heads × head dim)."""
    config = transformer.config
    return int(config.num_attention_heads * config.attention_head_dim)


def feature_blocks(critic: nn.Module, blocks: Sequence[int]) -> list[int]:
    """``blocks`` as sorted non-negative indices into ``critic.blocks`` (-1 = the last); a clear error for an index
    the critic has not."""
    if not hasattr(critic, "blocks"):
        raise ValueError(f"the GAN head reads the critic's transformer blocks; {type(critic).__name__} has no "
                         f"`blocks` (use a Wan critic, or set gan.critic_weight and gan.generator_weight to 0)")
    n = len(critic.blocks)
    wrong = [b for b in blocks if not -n <= b < n]
    if wrong or not blocks:
        raise ValueError(f"gan.blocks={list(blocks)}: the critic has {n} blocks, so each index lies in "
                         f"[{-n}, {n - 1}] (-1 = the last) and at least one is given")
    return sorted({b % n for b in blocks})


def attach_head(critic: nn.Module, seed: int, blocks: Sequence[int] = (-1,), hidden: int = 64,
                space: str = "critic") -> nn.Module:
    """Give ``critic`` (a Wan transformer: ``blocks``) its GAN head on the features of ``blocks`` (``space="pixels"``:
    a ``PixelDiscriminator`` on decoded clips, stepping with the critic all the same), initialised from ``seed``
    without touching the global RNG (the run's other draws stay where they were). Returns the head."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if space == "pixels":
            config = critic.config  # the text rows' width: Wan's `text_dim`, an MMDiT's `joint_attention_dim`
            head = PixelDiscriminator(int(config.text_dim if "text_dim" in config else config.joint_attention_dim))
        else:
            head = FeatureClassifier(feature_dim(critic) * len(feature_blocks(critic, blocks)), hidden)
    first = next(critic.parameters())
    critic.add_module(HEAD, head.to(device=first.device))
    return head


@contextlib.contextmanager
def block_features(transformer: nn.Module, blocks: Sequence[int] = (-1,)) -> Iterator[Callable[[], torch.Tensor]]:
    """Inside the context, the hidden states (B, N, D) each of ``transformer.blocks[i]`` (i in ``blocks``) outputs
    are kept (forward hooks; the transformer's output is unchanged); the context yields a function returning the
    last forward's, concatenated in block order on the feature axis, (B, N, k·D)."""
    indices = feature_blocks(transformer, blocks)
    found: dict[int, torch.Tensor] = {}

    def keep(index: int):
        return lambda _module, _args, output: found.__setitem__(index, output)

    handles = [transformer.blocks[i].register_forward_hook(keep(i)) for i in indices]

    def features() -> torch.Tensor:
        missing = [i for i in indices if i not in found]
        if missing:
            raise RuntimeError(f"no forward of the critic ran blocks {missing} inside block_features")
        return torch.cat([found[i] for i in indices], dim=-1)

    try:
        yield features
    finally:
        for handle in handles:
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


def tapped(x: torch.Tensor, norms: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """``x`` as a new node of the graph whose backward records the norm of the gradient reaching it through this
    node alone in ``norms[key]``: feed one loss term ``tapped(x0, ...)`` and another ``x0`` (or its own tap) and one
    backward tells each term's pull on x0 apart (the GAN term's against DMD's), at no extra cost."""
    y = x.view_as(x)
    if y.requires_grad:
        y.register_hook(lambda grad: norms.__setitem__(key, grad.detach().float().norm()))
    return y

