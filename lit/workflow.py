"""Serve a cross-model workflow: prompts → (refiners →) text-to-image → image-to-video, stage by stage.

Each stage is a generator of the card (``<stage>_transformer`` and its VAE and text encoders, its own
sampler and size) or a group of refiner LMs; each one's output feeds the next one's conditioning
(``modules/rl/workflow.py``). ``predict`` returns every stage's output, and ``callbacks.MediaWriter`` writes
each generator stage's images (PNG) and videos under a folder of the stage's name.

    posttrain predict --config configs/workflow_t2i_i2v.yaml
    posttrain export --ckpt <a workflow_rl checkpoint> --expert t2i_transformer --out exported/t2i
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from posttrain.lit.base import ExpertModule, RunArgs, stage_serving_settings
from posttrain.modules.io import batch as batch_schema
from posttrain.modules.models.cards import ModelCard
from posttrain.modules.rl.workflow import Stage, StageOutput, WorkflowPlan


class Workflow(ExpertModule):
    """Args:
        card: the experts of every stage, namespaced by stage (``t2i_transformer``, ``i2v_vae``, …) and
            the refiners of a refiner stage.
        stages: the stages in order (see ``modules.workflow.Stage``).
        run: the seed and NaN tolerance (each stage has its own size).
    """

    def __init__(self, card: ModelCard, stages: list[Stage], run: Optional[RunArgs] = None):
        super().__init__(card, None, run)
        self.plan = WorkflowPlan(card, stages)
        problems = self.plan.problems()
        if problems:
            raise ValueError("workflow:\n  - " + "\n  - ".join(problems))
        self.stages = self.plan.stages
        # the base's generator is the stage that makes the final output
        self.stage = self.plan.generators[self.stages[-1].name]

    def check_sizes(self) -> None:
        self.plan.check_sizes()

    @property
    def reads_first_frames(self) -> bool:
        return False  # its image stage makes the image-to-video stage's first frames

    # ------------------------------------------------------------------ serving
    def stage_seeds(self, seed: int) -> dict[str, int]:
        """The noise seed of each stage for one call (distinct per stage, a pure function of ``seed``)."""
        return {stage.name: seed * 1000 + i for i, stage in enumerate(self.stages)}

    @torch.no_grad()
    def run_stages(self, prompts: list[str], seed: int = 0, seeds: Optional[dict[str, int]] = None
                   ) -> dict[str, StageOutput]:
        """Every stage's output for ``prompts`` (``seeds`` overrides the per-stage seeds of ``seed``)."""
        return self.plan.serve(prompts, {**self.stage_seeds(seed), **(seeds or {})}, self.device)

    @torch.no_grad()
    def generate(self, prompts: list[str], seed: int = 0, latents_only: bool = False,
                 images: Optional[torch.Tensor] = None, latents: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(B, 3, F, H, W) final media of the workflow in [-1, 1]."""
        if latents_only or images is not None or latents is not None:
            raise ValueError("a workflow generates from prompts alone and returns its final media")
        return self.run_stages(prompts, seed)[self.stages[-1].name].media

    def predict_step(self, batch: dict, batch_idx: int) -> dict:
        outputs = self.run_stages(list(batch["prompt"]), batch_schema.seed(batch, batch_idx))
        return {"prompts": list(batch["prompt"]), "videos": outputs[self.stages[-1].name].media.cpu(),
                "stages": {name: (out.media.cpu() if out.media is not None else out.prompts)
                           for name, out in outputs.items()}}

    def serving_settings(self) -> dict[str, Any]:
        """One entry per generator stage, keyed by its transformer (``posttrain export --expert`` picks one)."""
        return {"stages": {self.plan.generators[s.name].transformer:
                           stage_serving_settings(self.plan.generators[s.name], s.sampler, s.size,
                                                  self.plan.generators[s.name].transformer)
                           for s in self.stages if s.kind == "generator"}}
