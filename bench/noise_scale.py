"""The gradient noise scale of n gradient estimates at one point (McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training"), from their dot products alone: what ``experiments/gradient_noise.py`` measures of RL updates.

For n gradients g_i with mean ḡ:

- tr Σ = Σ_i |g_i − ḡ|² / (n − 1), the noise of one estimate;
- |G|² = |ḡ|² − tr Σ / n, an unbiased estimate of the squared norm of the expected gradient;
- the noise scale B = tr Σ / |G|² (∞ when |G|² ≤ 0), in estimates: how many must be averaged for the signal to
  equal the noise; its interval takes |G|² within two jackknife standard errors (leave one gradient out);
- the mean cosine between two different gradients (≈ 1 / (1 + B) when the estimates agree).
"""
from __future__ import annotations

import math

import torch


def gram_of(grads: torch.Tensor, rows: int = 32) -> torch.Tensor:
    """(n, n) float64 dot products of n gradients (n, P), a block of rows at a time (float64 copies stay small).
    Every estimate below needs only these."""
    out = torch.zeros(len(grads), len(grads), dtype=torch.float64)
    blocks = [grads[i:i + rows].double() for i in range(0, len(grads), rows)]
    for i, a in enumerate(blocks):
        for j, b in enumerate(blocks[i:], start=i):
            block = a @ b.T
            out[i * rows:i * rows + len(a), j * rows:j * rows + len(b)] = block
            out[j * rows:j * rows + len(b), i * rows:i * rows + len(a)] = block.T
    return out


def _estimates(total: torch.Tensor, diagonal: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tr Σ, |G|²) of n gradients from the sum of all their dot products and the sum of their squared norms."""
    squared_mean = total / n ** 2  # |ḡ|²
    trace = (diagonal - n * squared_mean) / (n - 1)  # Σ|g_i − ḡ|² / (n − 1)
    return trace, squared_mean - trace / n


def noise_scale(gram: torch.Tensor) -> tuple[float, float, float]:
    """(B in iterations, tr Σ, |G|²) of the n gradients of ``gram`` (``gram_of``); B = ∞ when |G|² ≤ 0."""
    trace, signal = (x.item() for x in _estimates(gram.sum(), gram.diagonal().sum(), len(gram)))
    return (trace / signal if signal > 0 else math.inf), trace, signal


def mean_cosine(gram: torch.Tensor) -> float:
    """The mean cosine between two different gradients of ``gram``."""
    norms = gram.diagonal().clamp_min(1e-300).sqrt()
    cosines = gram / norms[:, None] / norms[None, :]
    n = len(gram)
    return ((cosines.sum() - cosines.diagonal().sum()) / (n * (n - 1))).item()


def interval(gram: torch.Tensor) -> tuple[float, float]:
    """B's range for |G|² within two jackknife standard errors (leave one iteration out); tr Σ held at its
    estimate (its own error is small beside |G|²'s). ∞ at the top when |G|² cannot be told from 0."""
    n = len(gram)
    _, trace, signal = noise_scale(gram)
    # without gradient i: the dot products' sum loses its row and column, the squared norms lose G_ii
    diagonal = gram.diagonal()
    _, leave_out = _estimates(gram.sum() - 2 * gram.sum(1) + diagonal, diagonal.sum() - diagonal, n - 1)
    se = math.sqrt((n - 1) / n * ((leave_out - leave_out.mean()) ** 2).sum().item())
    low = trace / (signal + 2 * se)
    return low, (trace / (signal - 2 * se) if signal - 2 * se > 0 else math.inf)
