"""Self-Forcing: a block-causal video student trained on its own chunk-by-chunk rollouts.

Huang et al. 2025, "Self Forcing: Bridging the Train-Test Gap in Autoregressive Video Diffusion" (reference
code ``guandeh17/Self-Forcing``, ``pipeline/self_forcing_training.py`` and ``model/dmd.py``). The student is a
block-causal Wan transformer (``arch: wan_t2v_causal``, ``modules/causal_wan.py``) started from the
bidirectional teacher's weights. It rolls out exactly as it serves: chunk by chunk (``sampler.chunk_frames``
latent frames), each chunk through the few-step list while attending to the finished chunks in a KV cache,
each finished chunk re-run at σ = 0 without grad to fill the cache. One exit step per iteration, drawn from a
generator seeded alike on every process, is the same for every chunk: steps before it run without grad,
its x̂0 keeps grad. So the student trains on its own history (no teacher-forced context), and the loss is
DMD2's on the whole rolled-out video: the frozen bidirectional teacher's CFG score against a critic's, the
critic trained by flow matching on the detached rollouts every iteration, the student every
``generator_update_ratio``-th. Math: METHODS.md (self_forcing, dmd2), ``modules/losses.py``.

    posttrain fit --config configs/self_forcing.yaml
"""
from __future__ import annotations

from posttrain.lit.dmd2 import DMD2
from posttrain.modules import presets
from posttrain.modules.cards import ModelCard


class SelfForcing(DMD2):
    """Args:
        card: needs ``transformer`` (the block-causal student: ``arch: wan_t2v_causal``, trainable), ``critic``
            (the fake score, trainable), ``teacher`` (frozen, bidirectional), ``text_encoder`` and ``vae``;
            student and critic usually start from the teacher (``init_from: teacher``).
        sampler: the student's chunked few-step sampler (``chunk_frames``, ``step_sigmas``, re-noise step); it
            rolls out in training and serves ``predict`` and sample videos.
        teacher_sampler: the teacher's many-step CFG sampler, the target ``validation_step`` compares with;
            None = ``FlowMatchSampler(guidance_scale=guidance_scale)``.
        generator_update_ratio: N; the student steps on iterations 0, N, 2N, … (anchor 5).
        guidance_scale: the teacher's CFG on the real score; the critic has none.
        sigma_range: the σ at which both scores are taken and the critic trains, drawn uniformly from this
            range (anchor 0.02–0.98), then flow-shifted by ``shift``.
        shift: flow shift of those σ.
        run: size of generated videos, seed, NaN tolerance.
    """

    method = "self_forcing"

    # training_step and validation_step are DMD2's: the sampler's chunk loop (``chunk_frames``, KV cache) makes
    # ``stage.sample`` the causal rollout (as served), and the DMD loss and the critic's flow matching then take the
    # whole rolled-out video

    def student_problems(self, card: ModelCard) -> list[str]:
        if self.sampler.chunk_frames is not None:  # (with chunk_frames set, card_problems checks the arch)
            return []
        problems = ["sampler.chunk_frames is not set: self_forcing rolls out chunk by chunk; set it to the latent "
                    "frames per chunk (anchor 3; it must divide the video's latent frames)"]
        student = card.specs.get("transformer")
        if student is not None and not presets.causal(student.arch):
            problems.append(f"`transformer` has arch {student.arch!r}; the self_forcing student is block-causal: "
                            f"set `arch: wan_t2v_causal` (wan_t2v's weights, `init_from: teacher`)")
        return problems
