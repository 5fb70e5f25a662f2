"""Wan 2.2 A14B as a pair of noise experts on one card: ``transformer`` (t >= boundary) and ``transformer_2``
(the rest), handed over at the card's ``boundary_ratio`` as diffusers' ``WanPipeline`` does. Tiny random Wan
transformers of the real class, the world's UMT5 and VAE."""
from __future__ import annotations

import json
import os
from typing import Optional

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

from posttrain.callbacks.parity import LogProbParityCheck
from posttrain.datamodules.prompts import Prompts
from posttrain.datamodules.synthetic import SyntheticVideos
from posttrain.lit.base import RunArgs
from posttrain.lit.finetune import Finetune
from posttrain.lit.flow_grpo import FlowGRPO
from posttrain.lit.tools.export import export
from posttrain.modules.flow.samplers import FlowMatchSampler
from posttrain.modules.models.cards import Expert, LoraConfig, ModelCard
from posttrain.modules.rl.grpo import GRPOArgs
from posttrain.modules.rl.rollout import Rollout
from tests.conftest import TINY_WAN, adamw
from tests.helpers import quick_trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["a red circle moving left on a blue background", "a yellow square moving down on a green background"]
RUN = RunArgs(frames=5, height=16, width=16)
PAIR = ("transformer", "transformer_2")


def pair_card(trains: tuple[str, ...] = PAIR, boundary_ratio: float = 0.875, lr: float = 1e-2,
              lora: bool = False) -> ModelCard:
    """The world's UMT5 and VAE (frozen) + two tiny random Wan transformers, the ones in ``trains`` trainable."""
    def expert(name: str) -> Expert:
        trainable = name in trains
        return Expert(arch="wan_t2v", preset=TINY_WAN, trainable=trainable, optimizer=adamw(lr) if trainable else None,
                      lora=LoraConfig(rank=4, alpha=4.0) if lora and trainable else None)

    return ModelCard({"text_encoder": Expert(arch="umt5"), "vae": Expert(arch="wan_vae"),
                      **{name: expert(name) for name in PAIR}}, text_max_length=32, boundary_ratio=boundary_ratio)


def record_timesteps(card: ModelCard) -> dict[str, list[float]]:
    """expert -> the timesteps of every forward it runs (one entry per call: the first row's)."""
    calls: dict[str, list[float]] = {name: [] for name in PAIR}
    for name in PAIR:
        card.models[name].register_forward_pre_hook(
            lambda module, args, kwargs, name=name: calls[name].append(float(kwargs["timestep"][0])), with_kwargs=True)
    return calls


def weights(card: ModelCard, name: str) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in card.models[name].state_dict().items()}


def test_card_refuses_a_pair_without_a_boundary_and_a_boundary_without_a_pair():
    experts = {"text_encoder": Expert(arch="umt5"), "vae": Expert(arch="wan_vae"),
               "transformer": Expert(arch="wan_t2v"), "transformer_2": Expert(arch="wan_t2v")}
    with pytest.raises(ValueError, match="'transformer_2' is the low-noise expert .* set the card's boundary_ratio"):
        ModelCard(experts)
    with pytest.raises(ValueError, match=r"boundary_ratio=1.5 must be in \(0, 1\)"):
        ModelCard(experts, boundary_ratio=1.5)
    experts.pop("transformer_2")
    with pytest.raises(ValueError, match="boundary_ratio=0.875 hands the low-noise steps to `transformer_2`"):
        ModelCard(experts, boundary_ratio=0.875)


@pytest.mark.parametrize("guidance", [1.0, 3.0], ids=["no_cfg", "cfg3"])
def test_a_sample_switches_expert_exactly_at_the_boundary(guidance):
    """8 Euler steps at shift 1: timesteps 1000, 857.29, 714.57, …; the boundary set to exactly the second step's
    timestep (float32 ``t >= boundary``, WanPipeline's test): steps 0-1 run ``transformer``, steps 2-7
    ``transformer_2``, one forward per step (CFG's two passes are one batched forward)."""
    sampler = FlowMatchSampler(num_steps=8, guidance_scale=guidance,
                               scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0))
    timesteps = sampler.schedule().timesteps.tolist()
    card = pair_card(boundary_ratio=timesteps[1] / 1000)
    module = Finetune(card, sampler=sampler, run=RUN)
    module.configure_model()
    assert torch.tensor(module.stage.boundary_timestep, dtype=torch.float32) == timesteps[1]  # the edge itself
    calls = record_timesteps(card)
    module.generate(PROMPTS, seed=0, latents_only=True)
    assert calls == {"transformer": timesteps[:2], "transformer_2": timesteps[2:]}
    assert [module.stage.expert_at(t) for t in timesteps] == ["transformer"] * 2 + ["transformer_2"] * 6


def test_rows_of_mixed_noise_run_on_their_own_expert():
    """One call with per-row timesteps on both sides of the boundary (a training batch): each row's velocity is
    exactly what its own expert gives its rows (the same rows batched alike: bitwise)."""
    card = pair_card()
    card.build()
    module = Finetune(card, run=RUN)
    stage = module.stage
    cond = stage.condition(PROMPTS + PROMPTS[:1])
    x = torch.randn(3, *stage.latent_shape(RUN.video), generator=torch.Generator().manual_seed(0))
    t = torch.tensor([900.0, 100.0, 875.0])  # high, low, high (at the edge)
    with torch.no_grad(), stage.velocity() as pair, stage.velocity("transformer") as high, \
            stage.velocity("transformer_2") as low:
        v = pair(x, t, cond)
        rows_high = torch.tensor([0, 2])
        v_high = high(x[rows_high], t[rows_high], cond.select(rows_high))
        v_low = low(x[1:2], t[1:2], cond.select([1]))
        assert not torch.allclose(high(x, t, cond), low(x, t, cond))  # two different experts
    assert torch.equal(v[rows_high], v_high.float()) and torch.equal(v[1:2], v_low.float())


@pytest.mark.parametrize("trained", PAIR)
def test_training_one_expert_leaves_the_other_bitwise_unchanged(trained):
    """Finetune with one expert trainable: σ is drawn in its range, so the frozen expert never runs in training
    (no forward), its weights stay bitwise equal, and only the trained one's version counts its steps."""
    card = pair_card(trains=(trained,))
    module = Finetune(card, sampler=FlowMatchSampler(num_steps=4), caption_dropout=0.0, run=RUN)
    module.configure_model()
    frozen = next(n for n in PAIR if n != trained)
    before = {name: weights(card, name) for name in PAIR}
    calls = record_timesteps(card)
    quick_trainer(3).fit(module, SyntheticVideos(num_samples=8, batch_size=2, frames=5, height=16, width=16))
    boundary = module.stage.boundary_timestep
    assert calls[frozen] == [] and len(calls[trained]) == 3
    assert all((t >= boundary) == (trained == "transformer") for t in calls[trained])
    after = {name: weights(card, name) for name in PAIR}
    assert all(torch.equal(before[frozen][k], after[frozen][k]) for k in before[frozen])
    assert any(not torch.equal(before[trained][k], after[trained][k]) for k in before[trained])
    assert card.versions[trained] == 3 and card.versions[frozen] == 0
    assert len(module.trainer.optimizers) == 1


def flow_grpo(card: ModelCard, sampler: Optional[FlowMatchSampler] = None, **grpo) -> FlowGRPO:
    """FlowGRPO on the default sampler (8 steps at shift 3: timesteps 1000, 947.5, 882.8 are >= 875, the rest
    below): every step stochastic and trained, K = 2."""
    return FlowGRPO(card, sampler=sampler or FlowMatchSampler(num_steps=8),
                    grpo=GRPOArgs(**{"num_samples_per_prompt": 2, "timestep_fraction": 1.0, "kl_beta": 0.004,
                                     **grpo}), run=RUN)


@pytest.mark.parametrize("guidance", [(1.0, None), (4.0, 3.0)], ids=["no_cfg", "cfg4_low3"])
def test_flow_grpo_logprob_parity_holds_on_steps_of_either_expert(guidance):
    """The log p recomputed through the pair reproduces the captured one on the high-noise steps and on the
    low-noise steps (< 1e-5, float32), also with each expert's own CFG scale (Wan 2.2 A14B's 4.0 and 3.0);
    recomputed with one expert alone it does not (control)."""
    module = flow_grpo(pair_card(), FlowMatchSampler(num_steps=8, guidance_scale=guidance[0],
                                                     guidance_scale_2=guidance[1]))
    module.configure_model()
    stage, sampler = module.stage, module.rollout_sampler
    cond, uncond = module.conditioning(PROMPTS, sampler)
    rollout = Rollout.sample(stage, sampler, cond, uncond, stage.latent_shape(RUN.video),
                             torch.Generator().manual_seed(0))
    experts = [stage.expert_at(float(t)) for t in rollout.traj.timesteps]
    assert experts == ["transformer"] * 3 + ["transformer_2"] * 5
    gap = (rollout.recompute_log_probs() - rollout.traj.log_probs).abs()  # (T, B)
    high, low = gap[:3].max().item(), gap[3:].max().item()
    print(f"log-probability parity through the pair: high-noise steps {high:.1e}, low-noise steps {low:.1e}")
    assert high < 1e-5 and low < 1e-5
    alone = (rollout.recompute_log_probs("transformer_2") - rollout.traj.log_probs).abs()
    assert alone[:3].max() > 1e-3  # transformer_2 alone is wrong on the high-noise expert's steps
    if guidance[1] is None:  # and right on its own (run alone it is no pair: it guides with guidance_scale)
        assert alone[3:].max() < 1e-5


def test_both_experts_train_under_flow_grpo_with_two_optimizers_and_two_versions():
    """Both experts trainable: each iteration's update trains the steps of both, so each expert steps its own
    optimizer once per iteration (two optimizers, two versions that count iterations), with parity checked before
    every update; each KL reference is its expert's own."""
    card = pair_card()
    module = flow_grpo(card)
    module.configure_model()
    before = {name: weights(card, name) for name in PAIR}
    parity = LogProbParityCheck(every_n_iterations=1, tolerance=1e-5)
    quick_trainer(2, callbacks=[parity]).fit(module, Prompts(prompts=PROMPTS, batch_size=2))
    assert len(module.trainer.optimizers) == 2
    assert parity.checks == 2 and parity.last_gap < 1e-5
    assert card.versions["transformer"] == card.versions["transformer_2"] == 2
    assert {"transformer_reference", "transformer_2_reference"} <= set(card.roles)
    assert module.stage.pair_of(module.reference) == ("transformer_reference", "transformer_2_reference")
    for name in PAIR:
        assert any(not torch.equal(before[name][k], v) for k, v in card.models[name].state_dict().items())


def test_flow_grpo_trains_only_the_steps_of_the_expert_that_trains():
    """Only the low-noise expert trains: updates run on its 5 steps alone, the high-noise expert is its own
    reference and stays bitwise unchanged."""
    card = pair_card(trains=("transformer_2",))
    module = flow_grpo(card)
    module.configure_model()
    before = weights(card, "transformer")
    calls = record_timesteps(card)
    quick_trainer(1).fit(module, Prompts(prompts=PROMPTS, batch_size=2))
    # rollout: 8 forwards (3 high, 5 low); update: 5 low steps, each with its reference (transformer_2_reference)
    assert len(calls["transformer"]) == 3 and len(calls["transformer_2"]) == 5 + 5
    assert module.stage.pair_of(module.reference) == ("transformer", "transformer_2_reference")
    assert all(torch.equal(before[k], v) for k, v in card.models["transformer"].state_dict().items())
    assert card.versions == {**card.versions, "transformer": 0, "transformer_2": 1}


@pytest.mark.parametrize("guidance", [(1.0, None), (3.0, None), (3.0, 1.5)], ids=["no_cfg", "cfg3", "cfg3_low1.5"])
def test_export_as_wan_pipeline_with_transformer_2_reproduces_predict(tmp_path, guidance):
    """Both experts finetuned with an EMA each, exported as one ``WanPipeline`` folder (``transformer``,
    ``transformer_2``, ``boundary_ratio`` in model_index.json); the pipeline from the same noise reproduces the
    package's samples: max |Δ latents| < 1e-4 (float32), with one CFG scale or the low-noise expert's own
    (``guidance_scale_2``). The boundary sits exactly on a step's timestep."""
    guidance, guidance_2 = guidance
    sampler = FlowMatchSampler(num_steps=8, guidance_scale=guidance, guidance_scale_2=guidance_2,
                               scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0))
    boundary = sampler.schedule().timesteps[3].item() / 1000
    module = Finetune(pair_card(boundary_ratio=boundary), sampler=sampler, caption_dropout=0.0, ema_decay=0.9, run=RUN)
    trainer = quick_trainer(2, default_root_dir=tmp_path)
    trainer.fit(module, SyntheticVideos(num_samples=8, batch_size=4, frames=5, height=16, width=16))
    ckpt = tmp_path / "run.ckpt"
    trainer.save_checkpoint(ckpt)
    module.eval()
    out = export(str(ckpt), str(tmp_path / "pipe"))
    assert {"transformer", "transformer_2"} <= set(os.listdir(out))
    pipe = WanPipeline.from_pretrained(out)
    assert pipe.config.boundary_ratio == boundary
    call = json.load(open(os.path.join(out, "serving.json")))
    assert call.pop("pipeline") == "WanPipeline" and call.pop("transformer") == "transformer_ema"
    assert call.get("guidance_scale_2") == guidance_2
    for name in PAIR:  # the EMAs serve
        ema = module.card[f"{name}_ema"].state_dict()
        assert all(torch.equal(getattr(pipe, name).state_dict()[k], ema[k]) for k in ema)
    ours = module.generate(PROMPTS, seed=7, latents_only=True)
    noise = torch.randn((len(PROMPTS), *module.stage.latent_shape(module.video)),
                        generator=torch.Generator().manual_seed(7))
    theirs = pipe(PROMPTS, latents=noise, output_type="latent", **call).frames
    gap = (ours - theirs).abs().max().item()
    print(f"WanPipeline (transformer_2, boundary_ratio {boundary}) vs predict, guidance {guidance}/{guidance_2}: "
          f"max |Δ latents| = {gap:.2e}")
    assert gap < 1e-4
    if guidance_2 is not None:  # the low-noise scale does reach the low-noise steps
        module.sampler.guidance_scale_2 = None
        assert (module.generate(PROMPTS, seed=7, latents_only=True) - ours).abs().max() > 1e-3


def test_guidance_scale_2_needs_a_pair_and_cfg():
    """``guidance_scale_2`` without CFG, or on a card with one generator, is refused by name."""
    with pytest.raises(ValueError, match="guidance_scale_2=3.0 guides the low-noise expert .* guidance_scale is 1"):
        FlowMatchSampler(guidance_scale_2=3.0)
    card = ModelCard({"text_encoder": Expert(arch="umt5"), "vae": Expert(arch="wan_vae"),
                      "transformer": Expert(arch="wan_t2v", preset=TINY_WAN, trainable=True, optimizer=adamw(1e-2))},
                     text_max_length=32)
    with pytest.raises(ValueError, match="sampler.guidance_scale_2=3.0 guides the low-noise expert of a pair"):
        Finetune(card, sampler=FlowMatchSampler(guidance_scale=4.0, guidance_scale_2=3.0), run=RUN)


@pytest.mark.parametrize("trained", [("transformer_2",), PAIR], ids=["low_noise", "both"])
def test_diffusion_nft_updates_the_experts_that_train(trained):
    """DiffusionNFT on the pair: rollouts from each trained expert's ``old`` copy (the frozen one runs itself), its
    flow-matching σ drawn in the trained experts' range; a frozen expert stays bitwise unchanged and runs no
    training forward, each trained one steps its own optimizer (boundary 0.5: both ranges get rows of the 2×4 σ)."""
    from posttrain.lit.diffusion_nft import DiffusionNFT

    card = pair_card(trains=trained, boundary_ratio=0.5)
    module = DiffusionNFT(card, sampler=FlowMatchSampler(num_steps=4), grpo=GRPOArgs(num_samples_per_prompt=2),
                          num_timesteps=2, run=RUN)
    module.configure_model()
    before = {name: weights(card, name) for name in PAIR}
    training_forwards = {name: 0 for name in PAIR}  # forwards with grad on: the policy's update
    for name in PAIR:
        card.models[name].register_forward_pre_hook(
            lambda m, args, name=name: training_forwards.__setitem__(name, training_forwards[name]
                                                                     + torch.is_grad_enabled()))
    quick_trainer(1).fit(module, Prompts(prompts=PROMPTS, batch_size=2))
    assert {f"{name}_old" for name in trained} <= set(card.roles)
    for name in PAIR:
        changed = any(not torch.equal(before[name][k], v) for k, v in card.models[name].state_dict().items())
        assert changed == (name in trained) and card.versions[name] == (name in trained)
        assert (training_forwards[name] > 0) == (name in trained), training_forwards


def test_diffusion_nft_refuses_a_sigma_range_outside_the_trained_experts_range():
    """Only the low-noise expert trains (σ < 0.5), but sigma_min is 0.6: no σ is left, refused at start-up."""
    from posttrain.lit.diffusion_nft import DiffusionNFT

    with pytest.raises(ValueError, match=r"sigma_min=0.6, sigma_max=0.98 leave no σ in \[0.0, 0.5\], the range of the "
                                         r"trained experts \['transformer_2'\] at boundary_ratio=0.5"):
        DiffusionNFT(pair_card(trains=("transformer_2",), boundary_ratio=0.5), sigma_min=0.6, run=RUN)


def test_dmd2_distills_from_a_pair_as_teacher():
    """DMD2's real score from a frozen pair ``teacher`` / ``teacher_2`` (the world's Wan twice; student and critic
    from ``teacher``): each noised row is scored by the teacher expert whose range holds its timestep."""
    from diffusers import FlowMatchEulerDiscreteScheduler as Euler

    from posttrain.lit.dmd2 import DMD2

    card = ModelCard({"text_encoder": Expert(arch="umt5"), "vae": Expert(arch="wan_vae"),
                      "teacher": Expert(arch="wan_t2v"), "teacher_2": Expert(arch="wan_t2v"),
                      "transformer": Expert(arch="wan_t2v", trainable=True, optimizer=adamw(1e-3), init_from="teacher"),
                      "critic": Expert(arch="wan_t2v", trainable=True, optimizer=adamw(1e-3), init_from="teacher")},
                     text_max_length=16, boundary_ratio=0.5)
    module = DMD2(card, FlowMatchSampler(num_steps=4, step_sigmas=[1.0, 0.75, 0.5, 0.25],
                                         scheduler=Euler(shift=3.0, stochastic_sampling=True)),
                  generator_update_ratio=1, teacher_sampler=FlowMatchSampler(num_steps=4, guidance_scale=4.5), run=RUN)
    module.configure_model()
    assert module.stage.pair_of("teacher") == ("teacher", "teacher_2") and module.stage.pair_of("critic") is None
    rows: dict[str, list[float]] = {"teacher": [], "teacher_2": []}
    for name in rows:
        card.models[name].register_forward_pre_hook(
            lambda m, args, kwargs, name=name: rows[name].extend(kwargs["timestep"].tolist()), with_kwargs=True)
    quick_trainer(4).fit(module, Prompts(prompts=PROMPTS * 2, batch_size=4))
    assert rows["teacher"] and rows["teacher_2"]  # 4 iterations × 4 rows (× 2 for CFG) of σ in [0.02, 0.98]
    assert min(rows["teacher"]) >= 500 and max(rows["teacher_2"]) < 500


def test_methods_of_one_generator_refuse_a_trainable_pair():
    """Finetune, FlowGRPO and DiffusionNFT train a pair of noise experts; joint RL's generator and DMD2's student do
    not: a card whose pair has a trainable expert is refused at start-up, naming the methods that train one (a frozen
    pair still serves joint RL's prompt-only training)."""
    from posttrain.lit.dmd2 import DMD2
    from posttrain.lit.joint_rl import JointRL
    from posttrain.modules.rl.refiner_args import RefinerArgs

    def card(trains: tuple[str, ...], dmd2: bool = False) -> ModelCard:
        """``pair_card`` plus DMD2's teacher and critic, or joint RL's refiner."""
        if dmd2:
            return ModelCard({**pair_card(trains).specs, "teacher": Expert(arch="wan_t2v", preset=TINY_WAN),
                              "critic": Expert(arch="wan_t2v", preset=TINY_WAN, trainable=True, optimizer=adamw(1e-3))},
                             text_max_length=32, boundary_ratio=0.875)
        return ModelCard(dict(pair_card(trains).specs), num_refiners=1, text_max_length=32, boundary_ratio=0.875,
                         refiner=Expert(arch="qwen2", trainable=True, optimizer=adamw(1e-3)))

    refused = (r"trains one generator, but the card's is a pair of noise experts \['transformer', 'transformer_2'\] "
               r"\(boundary_ratio=0.875\) with {} trainable: finetune, flow_grpo and diffusion_nft train a pair")
    refiners = RefinerArgs(num_unrefined=1)
    with pytest.raises(ValueError, match="joint_rl:" + r"(.|\n)*" + refused.format(r"\['transformer_2'\]")):
        JointRL(card(("transformer_2",)), FlowMatchSampler(num_steps=3), joint=False, refiners=refiners, run=RUN)
    with pytest.raises(ValueError, match=refused.format(r"\['transformer', 'transformer_2'\]")):
        JointRL(card(PAIR), FlowMatchSampler(num_steps=3), refiners=refiners, run=RUN)
    JointRL(card(()), FlowMatchSampler(num_steps=3), joint=False, refiners=refiners, run=RUN)  # a frozen pair serves
    with pytest.raises(ValueError, match="dmd2:" + r"(.|\n)*" + refused.format(r"\['transformer', 'transformer_2'\]")
                       + r" \(dmd2 distills from one as its frozen teacher"):
        DMD2(card(PAIR, dmd2=True), run=RUN)


def shrink_pair(cfg: dict) -> None:
    """configs/flow_grpo_wan22.yaml at the kill tests' size: 2 prompts × K = 2, 4 steps (the first 2 the high-noise
    expert's), 5×16×16 videos, no evaluation callback."""
    init = cfg["model"]["init_args"]
    init["run"] = {"frames": 5, "height": 16, "width": 16}
    init["grpo"]["num_samples_per_prompt"] = 2
    init["sampler"]["init_args"]["num_steps"] = 4
    cfg["trainer"]["callbacks"] = [c for c in cfg["trainer"]["callbacks"] if c["class_path"] != "Evaluate"]
    cfg["data"]["init_args"].update(num_synthetic=6, batch_size=2)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_kill_anywhere_resumes_the_pair_bitwise(tmp_path):
    """configs/flow_grpo_wan22.yaml (both experts trained, two optimizers, two versions, each KL reference): killed
    inside a checkpoint write, right after an epoch's last checkpoint and during a resume, resumed with
    ``--ckpt_path last``, it ends equal in every tensor of the final checkpoint to the run never killed."""
    from tests.test_kill_anywhere import draw_moments, hk, write_config

    import random

    steps, every, per_epoch = 8, 2, 3
    moments = draw_moments(random.Random("wan22"), steps, every, per_epoch, False, None)
    root, config = str(tmp_path), "configs/flow_grpo_wan22.yaml"
    straight = hk.run(write_config(root, "straight", config, steps, every, shrink_pair, None))
    assert straight.returncode == 0, straight.stderr[-4000:]
    for attempt, moment in enumerate(moments):
        done = hk.run(write_config(root, "killed", config, steps, every, shrink_pair, moment),
                      *(("--ckpt_path", "last") if attempt else ()))
        assert done.returncode != 0 and "Traceback" not in done.stderr, f"{moment}:\n{done.stderr[-4000:]}"
    final = hk.run(write_config(root, "killed", config, steps, every, shrink_pair, None), "--ckpt_path", "last")
    assert final.returncode == 0, final.stderr[-4000:]
    a = hk.checkpoint_contents(os.path.join(root, "straight", "checkpoints", "last.ckpt"))
    b = hk.checkpoint_contents(os.path.join(root, "killed", "checkpoints", "last.ckpt"))
    assert a["lightning.pt"]["global_step"] == steps and len(a) == len(b)
    assert not hk.differences(a, b), f"after kills {moments}: {hk.differences(a, b)[:5]}"
    print(f"flow_grpo_wan22: {len(moments)} kills survived bitwise: {moments}")


def test_a_lora_pair_exports_merged_and_each_adapter_alone(tmp_path):
    """Both experts trained through LoRA adapters: ``--lora merged`` writes the whole pair, which WanPipeline runs to
    the package's samples (< 1e-4); the default (one adapter alone) is refused naming both ways; ``--expert
    transformer_2 --pipeline false`` writes that expert's adapter."""
    sampler = FlowMatchSampler(num_steps=4)
    module = Finetune(pair_card(lora=True, boundary_ratio=0.9), sampler=sampler, caption_dropout=0.0, run=RUN)
    trainer = quick_trainer(2, default_root_dir=tmp_path)
    trainer.fit(module, SyntheticVideos(num_samples=8, batch_size=4, frames=5, height=16, width=16))
    ckpt = str(tmp_path / "run.ckpt")
    trainer.save_checkpoint(ckpt)
    with pytest.raises(ValueError, match="export the pair whole with --lora merged, or each expert's adapter alone"):
        export(ckpt, str(tmp_path / "refused"))
    assert "pytorch_lora_weights.safetensors" in os.listdir(export(ckpt, str(tmp_path / "low"), expert="transformer_2",
                                                                   pipeline=False))
    out = export(ckpt, str(tmp_path / "pipe"), lora="merged")
    pipe = WanPipeline.from_pretrained(out)
    call = {k: v for k, v in json.load(open(os.path.join(out, "serving.json"))).items()
            if k not in ("pipeline", "transformer")}
    module.eval()
    ours = module.generate(PROMPTS, seed=3, latents_only=True)
    noise = torch.randn((2, *module.stage.latent_shape(module.video)), generator=torch.Generator().manual_seed(3))
    gap = (ours - pipe(PROMPTS, latents=noise, output_type="latent", **call).frames).abs().max().item()
    print(f"WanPipeline (merged LoRA pair) vs predict: max |Δ latents| = {gap:.2e}")
    assert gap < 1e-4


def test_the_frozen_expert_can_wait_in_host_memory():
    """``card.park`` on the frozen expert of a pair (the low-noise one trains): it comes to the device only for the
    steps of its range (one call each: 3 of 8 at shift 3), and the samples are those of the pair unparked."""
    module = Finetune(pair_card(trains=("transformer_2",)), sampler=FlowMatchSampler(num_steps=8), run=RUN)
    module.configure_model()
    before = module.generate(PROMPTS, seed=0, latents_only=True)
    module.card.park("transformer", torch.device("cpu"))
    parked = module.card.parked["transformer"]  # a cards.Parked
    assert torch.equal(module.generate(PROMPTS, seed=0, latents_only=True), before) and parked.calls == 3
    with pytest.raises(ValueError, match="expert 'transformer_2' trains"):
        module.card.park("transformer_2", torch.device("cpu"))


def test_offload_weights_keeps_the_frozen_expert_in_host_memory_through_a_fit():
    """``offload_weights: true`` on the frozen expert of a pair: parked at the start of fit, before the module moves,
    its weights unchanged by training; refused on an expert that trains."""
    card = pair_card(trains=("transformer_2",))
    card.specs["transformer"].offload_weights = True
    module = Finetune(card, sampler=FlowMatchSampler(num_steps=4), run=RUN)
    before = None

    def keep(trainer, pl_module):
        nonlocal before
        before = weights(pl_module.card, "transformer")

    from lightning.pytorch.callbacks import LambdaCallback

    quick_trainer(2, callbacks=[LambdaCallback(on_fit_start=keep)]).fit(
        module, SyntheticVideos(num_samples=8, batch_size=2, frames=5, height=16, width=16))
    assert "transformer" in card.parked and "transformer_2" not in card.parked
    after = weights(card, "transformer")
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in after)
    with pytest.raises(ValueError, match="expert 'transformer_2': offload_weights keeps a frozen expert's weights in "
                                         "host memory, but it trains"):
        ModelCard({"text_encoder": Expert(arch="umt5"), "vae": Expert(arch="wan_vae"),
                   "transformer": Expert(arch="wan_t2v", preset=TINY_WAN),
                   "transformer_2": Expert(arch="wan_t2v", preset=TINY_WAN, trainable=True, optimizer=adamw(1e-2),
                                           offload_weights=True)}, text_max_length=32, boundary_ratio=0.875)


def test_estimate_counts_a_pairs_activations_once_and_offloaded_weights_on_the_host(tmp_path):
    """Each row runs one expert of the pair: the two experts' training activations are counted once; a frozen expert
    with ``offload_weights`` is in the host column."""
    from posttrain.lit.tools.estimate import estimate

    config = os.path.join(ROOT, "configs", "flow_grpo_wan22.yaml")
    both = {c.name: c for c in estimate(config).components}
    assert both["transformer"].activation_bytes > 0 and both["transformer_2"].activation_bytes == 0
    assert any("activations counted once, on 'transformer'" in n for n in both["transformer_2"].notes)
    text = open(config).read()
    start, end = text.index("        transformer_2:  # low noise\n"), text.index("      text_max_length:")
    frozen = text[:start] + ("        transformer_2:  # low noise, frozen, in host memory between its steps\n"
                             "          arch: wan_t2v\n          pretrained: modules/assets/wan22_t2v\n"
                             "          subfolder: transformer_2\n          offload_weights: true\n") + text[end:]
    path = tmp_path / "frozen_low.yaml"
    path.write_text(frozen)
    low = {c.name: c for c in estimate(str(path)).components}["transformer_2"]
    assert low.param_bytes == 0 and low.host_bytes == both["transformer_2"].param_bytes and "host" in low.placement
    with pytest.raises(ValueError, match="offload_weights keeps a frozen expert's weights in host memory, but it "
                                         "trains"):
        path.write_text(text.replace("          subfolder: transformer_2\n",
                                     "          subfolder: transformer_2\n          offload_weights: true\n"))
        estimate(str(path))


def test_flow_grpo_refuses_an_sde_window_outside_the_trained_experts_range():
    """Only the high-noise expert trains, but the SDE steps are the last 4 of 8 (all low noise): refused at start-up,
    naming the timesteps, the window and the fix."""
    module = FlowGRPO(pair_card(trains=("transformer",)), sampler=FlowMatchSampler(num_steps=8, sde_window=(4, 8)),
                      run=RUN)
    with pytest.raises(ValueError, match=r"no SDE step of the rollout sampler .* sde_window \(4, 8\).* "
                                         r"\['transformer'\] at boundary_ratio=0.875: widen sde_window"):
        module.configure_model()
