"""DMD2's two optional terms, each a group of settings declared, documented and checked once.

- ``GANArgs``: DMD2's GAN term (Yin et al. 2024, §4.2): a head on the critic's features (or a patch discriminator
  on the decoded clips, ``modules/distill/gan.py``) learns real samples from the student's in the critic's update,
  and the student adds the non-saturating loss of its x̂0 through the frozen head.
- ``RegressionArgs``: the first DMD's regression loss (Yin et al. 2023): the student's step from a teacher pair's
  noise regresses onto the teacher's sample from that noise.

A config sets them under ``model.init_args`` as ``gan: {critic_weight: 1.0e-2, generator_weight: 3.0e-3}`` and
``regression: {weight: 1.0, pairs: 2}`` (``configs/dmd2.yaml``). Both are off by default (weight 0). ``problems()``
returns every problem, each naming ``gan.<option>`` or ``regression.<option>``, its value and the fix; the method
collects them with its own before anything is built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass
class GANArgs:
    """Args:
        generator_weight: weight of the student's non-saturating GAN loss through the critic's head (DMD2's
            ``gen_cls_loss_weight``, anchor 3e-3 to 5e-3); 0 with ``critic_weight`` 0 = no GAN term.
        critic_weight: weight of the head's real-vs-fake loss in the critic's update (DMD2's
            ``guidance_cls_loss_weight``, anchor 1e-2); real = teacher samples of the batch's prompts, fake = the
            student's, both noised at a σ of the method's ``sigma_range`` (the reference's ``diffusion_gan``).
            0 = no GAN term.
        blocks: the critic's blocks whose output features the head reads, concatenated per token (-1 = the last,
            DMD2's bottleneck; several = a discriminator on several depths, as LADD's heads).
        space: where the head looks: ``critic`` (the critic's block features, DMD2's) or ``pixels`` (a 3-D PatchGAN
            on the VAE-decoded clips, conditioned on the prompt by projection, ``modules/distill/gan.py``: reals
            decoded as the student's samples are, the student's loss through the frozen decoder to its x̂0; not
            noised, spectral norm; ``blocks`` unused).
        reals: what the head learns as real: ``teacher`` (one teacher sample per training prompt) or ``data`` (the
            batch's own clips, encoded by the VAE, or its latents: DMD2's real images, which let the student move
            past its teacher; needs captioned videos as data, e.g. ``SyntheticVideos`` or ``VideoFolder``).
    """

    generator_weight: float = 0.0
    critic_weight: float = 0.0
    blocks: tuple[int, ...] = (-1,)
    space: Literal["critic", "pixels"] = "critic"
    reals: Literal["teacher", "data"] = "teacher"

    def __post_init__(self):
        self.blocks = tuple(self.blocks)

    @property
    def enabled(self) -> bool:
        """Whether the GAN term is on: the head learns only through the critic's weight."""
        return self.critic_weight > 0

    def problems(self) -> list[str]:
        """Every problem of these settings, each naming ``gan.<option>``, its value and the fix."""
        problems = []
        if self.generator_weight < 0 or self.critic_weight < 0:
            problems.append(f"gan.generator_weight={self.generator_weight} and gan.critic_weight={self.critic_weight} "
                            f"must be >= 0 (DMD2 anchors 3e-3 and 1e-2; both 0 = no GAN term)")
        elif self.generator_weight > 0 and self.critic_weight == 0:
            problems.append(f"gan.generator_weight={self.generator_weight} needs gan.critic_weight > 0: the head the "
                            f"student is scored by never learns otherwise (DMD2 anchor 1e-2)")
        choices = {"space": (self.space, {"critic": "the head on the critic's features, DMD2's",
                                          "pixels": "a patch discriminator on the decoded clips"}),
                   "reals": (self.reals, {"teacher": "teacher samples of the prompts",
                                          "data": "the batch's clips, DMD2's real images"})}
        wrong = [name for name, (value, meanings) in choices.items() if value not in meanings]
        for name in wrong:
            value, meanings = choices[name]
            problems.append(f"gan.{name}={value!r} must be " + " or ".join(f"'{k}' ({m})" for k, m in meanings.items()))
        # the options a run without the GAN term would ignore
        given = {"blocks": (self.blocks != (-1,), f"gan.blocks={list(self.blocks)} chooses the critic's blocks the "
                                                  f"GAN head reads"),
                 "space": (self.space != "critic", f"gan.space={self.space!r} chooses where the GAN head looks"),
                 "reals": (self.reals != "teacher", f"gan.reals={self.reals!r} chooses the GAN head's real samples")}
        if self.critic_weight == 0:
            problems += [f"{what}, but gan.critic_weight=0 has no GAN term: set gan.critic_weight > 0 or drop "
                         f"gan.{name}" for name, (chosen, what) in given.items() if chosen and name not in wrong]
        elif self.space == "pixels" and self.blocks != (-1,):
            problems.append(f"gan.blocks={list(self.blocks)} chooses the critic's blocks the GAN head reads, but "
                            f"gan.space='pixels' reads the decoded clips: drop gan.blocks or set gan.space: critic")
        return problems


@dataclass
class RegressionArgs:
    """Args:
        weight: weight of DMD's regression loss (Yin et al. 2023, the first DMD): the student's first step from a
            teacher pair's noise regresses onto the teacher's sample from that noise (latent MSE), added to the
            student's loss; 0 = off (DMD2's choice at ImageNet scale). A chunked student regresses each chunk's first
            step, rolled out chunk by chunk through its KV cache (as CausVid's ODE initialisation regresses a causal
            student onto the teacher's ODE).
        pairs: teacher (noise, sample) pairs per training prompt, drawn once (the method's ``teacher_pairs``).
        steps: which of the student's steps regress: ``first`` (DMD's: the first step from the pair's noise, as
            above) or ``every`` (CausVid's ODE regression: a random step k of the list, the same on every process,
            from the pair's sample noised by the pair's noise to σ_k — the input the step serves on when the steps
            before it drew the teacher's sample — onto that sample; a block-causal student runs the whole clip at σ_k
            under its chunk mask, so its first chunk sees nothing before it, as it serves).
        until: the term applies on iterations before this one only, a warm-up (DMD2's one-step SDXL student
            pre-trains on regression alone, then runs DMD without it; here DMD runs throughout); None = every
            iteration.
    """

    weight: float = 0.0
    pairs: int = 4
    steps: Literal["first", "every"] = "first"
    until: Optional[int] = None

    def applies(self, iteration: int) -> bool:
        """Whether the term is added at ``iteration``: on, and its warm-up not over."""
        return self.weight > 0 and (self.until is None or iteration < self.until)

    def problems(self) -> list[str]:
        """Every problem of these settings, each naming ``regression.<option>``, its value and the fix."""
        problems = []
        if self.weight < 0 or self.pairs < 1:
            problems.append(f"regression.weight={self.weight} must be >= 0 and regression.pairs={self.pairs} >= 1 "
                            f"(DMD's regression loss: 0 = off; pairs per training prompt)")
        if self.until is not None and self.until < 1:
            problems.append(f"regression.until={self.until} must be >= 1 (the iteration the regression stops at) or "
                            f"null (every iteration)")
        meanings = {"first": "DMD's", "every": "CausVid's ODE regression"}
        if self.steps not in meanings:
            problems.append(f"regression.steps={self.steps!r} must be " +
                            " or ".join(f"'{k}' ({m})" for k, m in meanings.items()))
        return problems


# dmd2's former flat keys and their place in these groups (the CLI's error for an old config names it)
MOVED = {"gan_generator_weight": "gan.generator_weight", "gan_critic_weight": "gan.critic_weight",
         "gan_blocks": "gan.blocks", "gan_space": "gan.space", "gan_reals": "gan.reals",
         "regression_weight": "regression.weight", "regression_pairs": "regression.pairs",
         "regression_steps": "regression.steps", "regression_until": "regression.until"}
