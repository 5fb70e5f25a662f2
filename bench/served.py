"""What a system's served videos show, judged against the facts a request asked: the measure behind
``experiments/rewrite_gap.py`` (a rewrite against the canonical caption of the same facts under the same noise).

Prompts are generated in batches of ``batch``, batch ``i`` from noise seed ``noise_seed + i``, as
``experiments/rl_compare.py`` evaluates: prompt ``j`` gets the same initial noise whatever text it is served, and
its conditioning is its own, so two prompt lists that agree at ``j`` give the same video at ``j``.
"""
from __future__ import annotations

import torch

from posttrain.modules.world.world import FACTS, Facts


@torch.no_grad()
def served_verdicts(module, prompts: list[str], facts: list[Facts], noise_seed: int, batch: int = 16,
                    sde: bool = False) -> torch.Tensor:
    """(B, 4) verdicts (1 / 0 / NaN where the request leaves the fact out, in ``FACTS`` order) of the generator's
    videos of ``prompts``, judged against ``facts`` (``geneval.judge_facts``). ODE serving (``ExpertModule.generate``:
    the generator alone, no refiner in between), or with ``sde`` as a joint RL rollout draws them (the module's
    ``rollout_sampler`` SDE step from the same initial noise)."""
    from posttrain.lit.base import ExpertModule
    from posttrain.modules.rl.rollout import Rollout
    from posttrain.modules.world.geneval import judge_facts

    if len(prompts) != len(facts):
        raise ValueError(f"served_verdicts: {len(prompts)} prompts for {len(facts)} facts; give one Facts per prompt")
    videos = []
    for k, i in enumerate(range(0, len(prompts), batch)):
        chunk = prompts[i:i + batch]
        if not sde:
            videos.append(ExpertModule.generate(module, chunk, seed=noise_seed + k).float())
            continue
        rng = torch.Generator().manual_seed(noise_seed + k)
        shape = module.stage.latent_shape(module.video)
        noise = torch.randn((len(chunk), *shape), generator=rng)
        cond, uncond = module.conditioning(chunk, module.rollout_sampler)
        rollout = Rollout.sample(module.stage, module.rollout_sampler, cond, uncond, shape, rng, sde=True, noise=noise)
        videos.append(module.stage.decode(rollout.latents).float())
    verdicts = judge_facts(torch.cat(videos), facts)
    return torch.stack([verdicts[f] for f in FACTS], dim=1)
