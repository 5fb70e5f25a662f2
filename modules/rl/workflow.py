"""Workflows: an ordered list of stages across models, each stage's output feeding the next one's conditioning.

A stage is a generator of the card (its own adapter, sampler and size) or a group of refiner LMs. What
flows between stages (DESIGN.md, "cross-model workflow"):

- text: a refiner stage rewrites the current prompts (each refiner adds its refinement, composed in
  order, as in joint RL); a generator reads the current prompts;
- an image: a generator of one frame (``frames: 1``, e.g. FLUX) makes images; the next generator that
  ``takes_image`` (Wan I2V) generates a video whose first frame is that image. A generator that reads no
  image after one that made media would drop it, which is refused.

**How a workflow holds several models.** One card, namespaced: generator stage ``t2i`` runs the experts
``t2i_transformer``, ``t2i_vae``, ``t2i_text_encoder`` (and ``t2i_text_encoder_2`` for FLUX) — a whole
pretrained model is such a group of experts, each ``pretrained`` from the model's folder and subfolder.
Every expert keeps its own optimizer, version, roles (``t2i_transformer_reference``) and place in the
checkpoint, so nothing in the card, the versions callback, the sharding strategy or the checkpoints had to
learn about workflows. A refiner stage names refiner experts of the same card (``refiner_0``…).

``Stage`` is the configuration (LightningCLI reads a list of them); ``WorkflowPlan`` binds them to a card,
checks that every stage can feed the next (all problems in one message), and serves the chain (``serve``)
through each stage's own sampler (workflow_rl rolls a stage out with its ``rollout_sampler``, by default the
same one).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

from posttrain.modules.models.cards import ModelCard
from posttrain.modules.models.generators import ADAPTERS, GeneratorStage, VideoSize
from posttrain.modules.models.refiners import DEFAULT_TEMPLATE, compose_prompt, sample_refinements
from posttrain.modules.flow.samplers import FlowMatchSampler


@dataclass
class Stage:
    """One stage of a workflow.

    Args:
        name: the stage's name; a generator stage runs the card's ``<name>_transformer``, ``<name>_vae`` and
            ``<name>_text_encoder`` (``_2``) experts.
        kind: ``generator`` (text [+ image] → image or video) or ``refiners`` (text → text).
        sampler: the generator's serving sampler (steps, scheduler, CFG); None = ``FlowMatchSampler()``.
        rollout_sampler: what workflow_rl rolls this stage out with (its SDE step, CFG, noise level) and
            recomputes the rollout with; None = ``sampler`` (train ≡ serve).
        frames, height, width: what the generator makes (``frames: 1``: an image).
        embedded_guidance: the guidance value a guidance-distilled generator embeds (FLUX-dev); None = the
            adapter's default.
        refiners: a refiner stage's LM experts, in composition order; None = all of the card's refiners.
        max_new_tokens, temperature, template: how a refiner stage samples (as joint_rl).
        trainable: workflow_rl trains this stage; false freezes it (ODE rollout, no optimizer, its
            version never moves), and its experts must be ``trainable: false`` on the card.
        credit: under workflow_rl's ``credit: per_stage``, the reward term this stage is credited with
            (e.g. ``colour`` for an image stage, ``motion`` for a video stage); None = the total.
    """

    name: str
    kind: Literal["generator", "refiners"] = "generator"
    sampler: Optional[FlowMatchSampler] = None
    rollout_sampler: Optional[FlowMatchSampler] = None
    frames: int = 1
    height: int = 32
    width: int = 32
    embedded_guidance: Optional[float] = None
    refiners: Optional[list[str]] = None
    max_new_tokens: int = 8
    temperature: float = 1.0
    template: str = DEFAULT_TEMPLATE
    trainable: bool = True
    credit: Optional[str] = None

    def __post_init__(self):
        self.sampler = self.sampler or FlowMatchSampler()
        self.rollout_sampler = self.rollout_sampler or self.sampler

    @property
    def size(self) -> VideoSize:
        return VideoSize(self.frames, self.height, self.width)


@dataclass
class StageOutput:
    """What a stage produced for the B samples: prompts (refiner stages: the composed ones), media (generator
    stages: (B, 3, F, H, W) in [-1, 1]) and, for a refiner stage, each refiner's text."""

    prompts: list[str]
    media: Optional[torch.Tensor] = None
    refinements: dict[str, list[str]] = field(default_factory=dict)


class WorkflowPlan:
    """``stages`` bound to ``card``: one ``GeneratorStage`` per generator stage, checked to chain."""

    def __init__(self, card: ModelCard, stages: list[Stage]):
        self.card = card
        self.stages = list(stages)
        self.generators = {s.name: GeneratorStage.named(card, s.name, embedded_guidance=s.embedded_guidance)
                           for s in self.stages if s.kind == "generator"}

    def refiners_of(self, stage: Stage) -> list[str]:
        return list(stage.refiners) if stage.refiners is not None else self.card.refiners

    def experts_of(self, stage: Stage) -> list[str]:
        """The experts a stage trains: its transformer, or its refiner LMs."""
        if stage.kind == "refiners":
            return self.refiners_of(stage)
        return [self.generators[stage.name].transformer]

    def problems(self) -> list[str]:
        """Every configuration problem of the chain, each naming the option (``stages[i]``) and the fix."""
        problems = []
        if not self.stages:
            return ["stages is empty: give at least one generator stage"]
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            problems.append(f"stage names {names} repeat; give every stage its own name")
        made: Optional[tuple[int, Stage]] = None  # the last generator stage before the current one
        for i, stage in enumerate(self.stages):
            where = f"stages[{i}] ({stage.name})"
            if stage.kind == "refiners":
                missing = [n for n in self.refiners_of(stage) if not self.card.has(n)]
                if not self.refiners_of(stage):
                    problems.append(f"{where} is a refiner stage but the card has no refiners: set card.num_refiners "
                                    f"and card.refiner, or name them in `refiners:`")
                if missing:
                    problems.append(f"{where}: the card has no {missing}")
                if made is not None:
                    problems.append(f"{where} refines prompts after generator stage {made[1].name!r}, whose output "
                                    f"it cannot read: move it before the generators")
                continue
            generator = self.generators[stage.name]
            stage_problems = [f"{where}: {p}" for p in generator.problems()]
            problems += stage_problems
            if stage_problems or generator.arch not in ADAPTERS:
                made = (i, stage)
                continue
            adapter = generator.adapter
            if adapter.takes_image:
                if made is None:
                    problems.append(f"{where}: {type(adapter).__name__} ({generator.transformer!r}) animates an image, "
                                    f"but no stage before it makes one: put an image stage (e.g. FLUX, frames: 1) "
                                    f"before it")
                elif made[1].frames != 1:
                    problems.append(f"{where} takes an image, but stages[{made[0]}] ({made[1].name}) makes "
                                    f"{made[1].frames}-frame videos: set its frames: 1")
                elif (made[1].height, made[1].width) != (stage.height, stage.width):
                    problems.append(f"{where} makes {stage.height}x{stage.width} videos from stages[{made[0]}] "
                                    f"({made[1].name})'s {made[1].height}x{made[1].width} images: give both stages "
                                    f"the same height and width")
            elif made is not None:
                problems.append(f"{where}: {type(adapter).__name__} reads no image, so stages[{made[0]}] "
                                f"({made[1].name})'s output would be dropped: use an image-to-video generator or "
                                f"remove one of them")
            made = (i, stage)
        if self.stages[-1].kind != "generator":
            problems.append(f"the last stage ({self.stages[-1].name}) is a refiner stage: a workflow ends with a "
                            f"generator")
        return problems

    def check_sizes(self) -> None:
        """Every generator stage's size against its VAE and patch factors (after the card is built)."""
        problems = []
        for stage in self.stages:
            if stage.kind == "generator":
                try:
                    self.generators[stage.name].latent_shape(stage.size)
                except ValueError as err:
                    problems.append(f"stage {stage.name!r}: {err}")
        if problems:
            raise ValueError("workflow:\n  - " + "\n  - ".join(problems))

    @torch.no_grad()
    def serve(self, prompts: list[str], seeds: dict[str, int], device: Optional[torch.device] = None,
              names: Optional[dict[str, str]] = None) -> dict[str, StageOutput]:
        """Run the chain on ``prompts``: refiner stages sample from an rng seeded ``seeds[name]``,
        generator stages ODE-sample (their sampler, CFG included) from ``torch.randn`` noise of that seed,
        the image-to-video stages on the previous stage's images. ``names`` maps a stage to the component
        that serves it (an EMA copy); default its transformer."""
        outputs: dict[str, StageOutput] = {}
        text, media = list(prompts), None
        for stage in self.stages:
            rng = torch.Generator().manual_seed(seeds[stage.name])
            if stage.kind == "refiners":
                refinements = {name: sample_refinements(self.card[name], self.card.tokenizers[name], text, rng,
                                                        stage.max_new_tokens, stage.temperature,
                                                        stage.template).texts
                               for name in self.refiners_of(stage)}
                text = [compose_prompt(p, [refinements[n][b] for n in refinements]) for b, p in enumerate(text)]
                outputs[stage.name] = StageOutput(text, refinements=refinements)
                continue
            generator = self.generators[stage.name]
            noise = torch.randn((len(text), *generator.latent_shape(stage.size)), generator=rng).to(device)
            images = media[:, :, 0] if generator.takes_image else None
            cond, uncond = generator.conditioning(text, stage.sampler.guidance_scale, device, images=images,
                                                  size=stage.size)
            latents = generator.sample(stage.sampler, noise, cond, uncond, name=(names or {}).get(stage.name)).latents
            media = generator.decode(latents)
            outputs[stage.name] = StageOutput(list(text), media=media)
        return outputs
