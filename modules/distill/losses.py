"""The distillation losses (DMD2's distribution matching, its GAN terms): tensors in, per-sample losses (B,) and
metrics out; the method picks the reduction."""
from __future__ import annotations

import torch


def dmd_generator_loss(x0: torch.Tensor, real_x0_cond: torch.Tensor, fake_x0: torch.Tensor,
                       real_x0_uncond: torch.Tensor | None = None, guidance_scale: float = 1.0
                       ) -> tuple[torch.Tensor, dict]:
    """Per-sample DMD2 generator loss (Yin et al. 2024, "Improved Distribution Matching Distillation", eq. 2 with
    DMD's normalized gradient, eq. 7–8; docs/methods.md#dmd2; reference Self-Forcing ``model/dmd.py``,
    ``_compute_kl_grad`` and ``compute_distribution_matching_loss``).

    ``x0`` is the student's sample x̂0 (with gradient); the three scores are x0 predictions at the same noised
    x_σ = (1-σ)·x̂0 + σ·ε, treated as constants:
    ``real = real_u + g·(real_c - real_u)`` (teacher CFG; no CFG without ``real_x0_uncond``), ``fake`` = the
    critic's x0 (no CFG). Then per sample ``grad = (fake - real) / mean|x̂0 - real|``, ``nan_to_num``, and
    ``L_G = 0.5·mean((x̂0 - sg(x̂0 - grad))²)``, whose gradient is ``grad / n`` (n elements per sample): it pushes
    x̂0 away from the critic's (fake) and towards the teacher's (real) denoising. Computed in float64 like the
    reference, so that x̂0 - (x̂0 - grad) keeps a small grad exact. Shapes (B, C, F, H, W) or any (B, ...).
    The guidance convention is docs/methods.md's: Self-Forcing's ``cond + g'·(cond - uncond)`` is g = g' + 1 here.
    The critic's own loss is ``flow_matching_loss`` on the detached samples (target ε - sg(x̂0)).

    Metrics: ``dmd_grad_abs`` mean |grad| (the reference's ``dmdtrain_gradient_norm``), ``dmd_normalizer`` mean of
    the per-sample mean|x̂0 - real|.
    """
    if real_x0_uncond is None and guidance_scale != 1.0:
        raise ValueError(f"guidance_scale={guidance_scale} needs the teacher's unconditional x0 (real_x0_uncond)")
    dims = tuple(range(1, x0.ndim))
    with torch.no_grad():
        real = real_x0_cond.double()
        if real_x0_uncond is not None:
            real = real_x0_uncond.double() + guidance_scale * (real - real_x0_uncond.double())
        normalizer = (x0.detach().double() - real).abs().mean(dim=dims, keepdim=True)
        grad = torch.nan_to_num((fake_x0.double() - real) / normalizer)
        target = x0.detach().double() - grad
    per_sample = 0.5 * (x0.double() - target).pow(2).mean(dim=dims)
    metrics = {"dmd_grad_abs": grad.abs().mean().float(), "dmd_normalizer": normalizer.mean().float()}
    return per_sample.float(), metrics


def gan_critic_loss(real_logits: torch.Tensor, fake_logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Per-sample DMD2 GAN loss of the critic's classifier (Yin et al. 2024, §4.2; reference ``sd_guidance.py``,
    ``compute_guidance_clean_cls_loss``): ``softplus(fake) + softplus(-real)``, the logistic loss of telling real
    (teacher) samples, logit → +∞, from fake (student) ones, logit → -∞. Logits (B,) each, row i of one against
    row i of the other. At logits 0 both terms are log 2. Metrics: mean sigmoid of each (the head's accuracy
    proxy: real → 1, fake → 0)."""
    per_sample = torch.nn.functional.softplus(fake_logits.float()) + torch.nn.functional.softplus(-real_logits.float())
    metrics = {"gan_real_prob": torch.sigmoid(real_logits.detach()).mean(),
               "gan_fake_prob": torch.sigmoid(fake_logits.detach()).mean()}
    return per_sample, metrics


def gan_generator_loss(fake_logits: torch.Tensor) -> torch.Tensor:
    """Per-sample non-saturating generator loss ``softplus(-fake)`` = -log sigmoid(fake) (Goodfellow et al. 2014;
    DMD2 ``compute_generator_clean_cls_loss``), (B,) logits of the student's samples by the frozen critic's head."""
    return torch.nn.functional.softplus(-fake_logits.float())
