"""A prepared one-GPU check at Wan2.1-T2V-1.3B scale: random weights of the real shape, nothing downloaded.

Builds ``WanTransformer3DModel`` with the 1.3B config (30 layers, 12 heads x 128, ffn 8960, text_dim 4096,
freq_dim 256, patch (1, 2, 2), 16 latent channels in and out) and measures, in one run on one device, with
the package's own sampler, losses and DeepSpeed configuration (``lit.engine.strategy.deepspeed_config``):

1. **finetune** — seconds per iteration (flow matching, AdamW, clipping) and MFU in bf16, and the peak
   device memory of three set-ups: plain PyTorch (fp32 master weights, bf16 autocast), ZeRO-3 bf16, and
   ZeRO-3 bf16 with optimizer and parameters offloaded to the host (one process: ZeRO-3 shards nothing,
   offload is what moves memory); each beside ``lit.tools.estimate``'s figure for the same expert;
2. **flow_grpo step, K = 8** — an SDE rollout of one prompt's group of 8 (one batched forward per step,
   log-probabilities captured), decoding by the real Wan 2.1 VAE architecture (random weights), and the
   PPO update on a fraction of the steps (one backward, one optimizer step): seconds of each part;
3. **causal student** — frames per second of the block-causal student generating the finetune video chunk by
   chunk through its KV cache (4 steps, chunks of 3 latent frames), without and with VAE decoding;
4. **few-step students** — seconds of one finetune-sized video sampled by the teacher (20 steps, CFG 4.5, as
   ``configs/dmd2.yaml``) and by 1-, 2- and 4-step students, the VAE decode apart: the speed-up and decode's share;
5. **attention kernels** — which ``scaled_dot_product_attention`` kernels a bf16 forward launches.

MFU = model FLOPs (3 x the forward's, counted by ``torch.utils.flop_counter`` without recompute) / time /
the device's dense bf16 peak (table below, or ``--peak-tflops``). Gradient checkpointing is on by default
(as in real recipes: without it, one 81x480x832 sample needs ~130 GiB of activations).

    python -m bench.gpu                 # one GPU, 1.3B shape; ~4-6 min on an H100/H200 (estimated: not yet run whole)
    python -m bench.gpu --tiny          # CPU, tiny shape: the same code paths in a minute (tested)
    python -m bench.gpu --skip offload  # parts to leave out: fewstep, plain, zero3, offload, rl, causal, attention
    python -m bench.gpu --skip plain zero3 offload rl causal attention --fewstep-video 33x480x832  # docs/benchmarks.md
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import socket
import time
import traceback
import warnings
from typing import Any, Callable, Optional

import torch

from posttrain.lit.dmd2 import student_sampler
from posttrain.modules.models.cards import Expert, ModelCard, ZeroConfig
from posttrain.modules.flow.conditioning import Conditioning
from posttrain.modules.models.generators import ADAPTERS, GeneratorStage, VideoSize
# Wan2.1-T2V-1.3B-Diffusers' transformer config, and its AutoencoderKLWan's (vae/config.json)
from posttrain.modules.models.published import WAN_1_3B, WAN_VAE
from posttrain.modules.flow.losses import flow_matching_loss, noised, sample_sigmas
from posttrain.modules.rl.rollout import Rollout, train_steps
from posttrain.modules.flow.samplers import FlowMatchSampler
from diffusers import FlowMatchEulerDiscreteScheduler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = dict(WAN_1_3B, num_attention_heads=2, attention_head_dim=32, text_dim=64, freq_dim=64, ffn_dim=128,
            num_layers=2, rope_max_seq_len=32)
# a small VAE of Wan 2.1's compression for --tiny
TINY_VAE = dict(base_dim=16, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
WAN = ADAPTERS["wan_t2v"]  # the package's Wan call: what every method runs
# dense bf16 peak, TFLOP/s (vendor datasheets, without sparsity)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
               "L40": 181.0, "A10": 125.0, "4090": 165.0, "B200": 2250.0}


def sizes(tiny: bool) -> dict[str, Any]:
    if tiny:
        return dict(config=TINY, frames=9, height=32, width=32, text_len=16, batch=2, rl_frames=9, rl_height=32,
                    rl_width=32, rl_steps=4, iterations=3, causal_chunk=1, fewstep_repeats=2, teacher_repeats=2)
    return dict(config=WAN_1_3B, frames=81, height=480, width=832, text_len=512, batch=1, rl_frames=33,
                rl_height=240, rl_width=416, rl_steps=10, iterations=4, causal_chunk=3, fewstep_repeats=2, teacher_repeats=1)


def vae_preset(s: dict) -> dict:
    """The bench's VAE: Wan2.1's (8x spatial, 4x temporal) at full size, a narrow one of the same compression at --tiny."""
    return TINY_VAE if s["config"] is TINY else WAN_VAE


def built_card(s: dict, device: Device, transformer: Expert) -> ModelCard:
    """A card built on ``device``: ``transformer``, the bench's VAE in its dtype and a one-layer text encoder
    (conditioning only) — what every part that runs the generator stage needs."""
    text = dict(d_model=s["config"]["text_dim"], d_kv=32, d_ff=256, num_layers=1, num_heads=2)
    card = ModelCard(experts={
        "text_encoder": Expert(arch="umt5", preset=text),
        "vae": Expert(arch="wan_vae", preset=vae_preset(s), dtype=vae_dtype(s["config"] is TINY)),
        "transformer": transformer,
    }, text_max_length=s["text_len"])
    with torch.device(device.name):
        card.build()
    card.to(device.name)
    return card


def vae_dtype(tiny: bool) -> str:
    """bf16 VAE weights on the GPU; float32 at --tiny (the CPU's bf16 3-D convolutions are far slower than its
    float32 ones: they took the flow_grpo part from seconds to minutes)."""
    return "float32" if tiny else "bfloat16"


def latent_shape(frames: int, height: int, width: int) -> tuple[int, int, int, int]:
    """Wan VAE latents: 16 channels, 4x temporal ((F-1)/4+1), 8x spatial."""
    return 16, (frames - 1) // 4 + 1, height // 8, width // 8


# ---------------------------------------------------------------------- measuring
class Device:
    def __init__(self, name: str):
        self.name, self.cuda = name, name.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_bytes(self, model: Optional[torch.nn.Module] = None) -> tuple[Optional[int], str]:
        """The device's peak allocated bytes since ``reset_peak``; on a CPU, the model states alive now
        (``bench/memory.py``'s count of live tensor storages), since the host has no allocator statistics."""
        if self.cuda:
            return torch.cuda.max_memory_allocated(), "peak allocated (torch.cuda)"
        if model is None:
            return None, "n/a"
        from bench.memory import live_bytes

        return live_bytes(model), "model states alive after the step (CPU: no allocator statistics)"

    def peak_tflops(self, override: Optional[float]) -> Optional[float]:
        if override:
            return override
        if not self.cuda:
            return None
        name = torch.cuda.get_device_name()
        return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def median(times: list[float]) -> float:
    return sorted(times)[len(times) // 2]


def timed(device: Device, fn: Callable[[], Any], iterations: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``iterations`` calls after ``warmup`` (the first builds optimizer state)."""
    for _ in range(warmup):
        fn()
    device.sync()
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        device.sync()
        times.append(time.perf_counter() - start)
    return times


def forward_flops(model: torch.nn.Module, x: torch.Tensor, timestep: torch.Tensor, cond: Conditioning,
                  autocast: contextlib.AbstractContextManager, adapter=WAN) -> int:
    """FLOPs of one forward of ``model`` through the generator ``adapter`` (``torch.utils.flop_counter``)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with torch.no_grad(), autocast, counter:
        adapter.velocity(model, x, timestep, cond)
    return counter.get_total_flops()


def init_distributed(device: Device) -> None:
    """A one-process group for DeepSpeed (NCCL on a GPU, gloo on the CPU)."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    deepspeed.init_distributed(dist_backend="nccl" if device.cuda else "gloo", auto_mpi_discovery=False,
                               verbose=False)


# ---------------------------------------------------------------------- the model and a batch
def build_plain(config: dict, device: Device, checkpointing: bool) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    with torch.device(device.name):
        model = WanTransformer3DModel(**config)
    if checkpointing:
        model.enable_gradient_checkpointing()
    return model.train()


def finetune_batch(s: dict, device: Device, g: torch.Generator) -> tuple[Any, ...]:
    """Clean latents, noise, text conditioning (random UMT5-sized rows) and σ of one finetune batch."""
    shape = latent_shape(s["frames"], s["height"], s["width"])
    x0 = torch.randn((s["batch"], *shape), generator=g).to(device.name)
    noise = torch.randn(x0.shape, generator=g).to(device.name)
    cond = Conditioning(encoder_hidden_states=torch.randn((s["batch"], s["text_len"], s["config"]["text_dim"]),
                                                          generator=g).to(device.name))
    sigma = sample_sigmas(s["batch"], "logit_normal", g).to(device.name)
    return x0, noise, cond, sigma


def timestep_of(sigma: torch.Tensor) -> torch.Tensor:
    return FlowMatchSampler().timestep_of(sigma)  # σ·1000, as the methods feed the transformer


def autocast(device: Device, enabled: bool = True):
    return torch.autocast("cuda" if device.cuda else "cpu", dtype=torch.bfloat16, enabled=enabled)


# ---------------------------------------------------------------------- 1. finetune
def finetune_plain(s: dict, device: Device, checkpointing: bool, peak_tflops: Optional[float]) -> dict:
    """fp32 master weights, bf16 autocast, torch AdamW: what ``precision: bf16-mixed`` under DDP runs."""
    device.reset_peak()
    model = build_plain(s["config"], device, checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=device.cuda or None)
    g = torch.Generator().manual_seed(0)

    def step():
        x0, noise, cond, sigma = finetune_batch(s, device, g)
        with autocast(device):
            v = WAN.velocity(model, noised(x0, noise, sigma), timestep_of(sigma), cond)
        loss = flow_matching_loss(v, x0, noise)[0].mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = timed(device, step, s["iterations"])
    peak, how = device.peak_bytes(model)
    x0, noise, cond, sigma = finetune_batch(s, device, g)
    flops = 3 * forward_flops(model, noised(x0, noise, sigma), timestep_of(sigma), cond, autocast(device))
    seconds = median(times)
    result = dict(seconds_per_iteration=seconds, times=times, peak_bytes=peak, peak_kind=how,
                  model_tflops_per_iteration=flops / 1e12,
                  params=sum(p.numel() for p in model.parameters()))
    if peak_tflops:
        result["mfu"] = flops / seconds / (peak_tflops * 1e12)
    return result


def zero3_expert(offload: bool, checkpointing: bool) -> Expert:
    return Expert(arch="wan_t2v", trainable=True, sharded=True, grad_clip=1.0, gradient_checkpointing=checkpointing,
                  optimizer=functools.partial(torch.optim.AdamW, lr=1e-5, weight_decay=0.0),
                  zero=ZeroConfig(stage=3, precision="bf16", offload_optimizer=offload, offload_params=offload))


def finetune_zero3(s: dict, device: Device, offload: bool, checkpointing: bool,
                   peak_tflops: Optional[float]) -> dict:
    """The engine ``ShardedExpertsStrategy`` gives ``sharded: true, zero: {stage: 3, precision: bf16}``."""
    import deepspeed
    from diffusers import WanTransformer3DModel

    from posttrain.lit.engine.strategy import deepspeed_config

    init_distributed(device)
    device.reset_peak()
    spec = zero3_expert(offload, checkpointing)
    with deepspeed.zero.Init(config_dict_or_path=deepspeed_config(spec), remote_device="cpu" if offload else None):
        model = WanTransformer3DModel(**s["config"])
    if checkpointing:
        model.enable_gradient_checkpointing()
    engine, *_ = deepspeed.initialize(model=model, optimizer=spec.optimizer(model.parameters()),
                                      config=deepspeed_config(spec, model))
    g = torch.Generator().manual_seed(0)

    def step():
        x0, noise, cond, sigma = finetune_batch(s, device, g)
        v = WAN.velocity(engine, noised(x0, noise, sigma), timestep_of(sigma), cond)
        loss = flow_matching_loss(v, x0, noise)[0].mean()
        engine.backward(loss)
        engine.step()

    times = timed(device, step, s["iterations"])
    peak, how = device.peak_bytes(model)
    seconds = median(times)
    result = dict(seconds_per_iteration=seconds, times=times, peak_bytes=peak, peak_kind=how)
    result["estimate_bytes"], result["estimate_model_state_bytes"], result["estimate_host_bytes"] = \
        estimate_bytes(spec, s)
    return result


def estimate_bytes(spec: Expert, s: dict) -> tuple[int, int, int]:
    """``lit.tools.estimate``'s device figure for the same expert, one process (a config written for it), its
    model states alone (what the CPU measurement sees) and what it puts in host memory (offload)."""
    import tempfile

    import yaml

    from posttrain.lit.tools.estimate import estimate

    expert: dict[str, Any] = {"arch": "wan_t2v", "trainable": True, "preset": dict(s["config"]),
                              "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-5}},
                              "gradient_checkpointing": spec.gradient_checkpointing}
    expert["preset"]["patch_size"] = list(expert["preset"]["patch_size"])
    if spec.sharded:
        expert.update(sharded=True, zero={"stage": spec.zero.stage, "precision": spec.zero.precision,
                                          "offload_optimizer": spec.zero.offload_optimizer,
                                          "offload_params": spec.zero.offload_params})
    text = {"arch": "umt5", "preset": {"d_model": s["config"]["text_dim"]}}  # what the estimate needs of it
    vae = {"arch": "wan_vae", "preset": vae_preset(s)}  # its latents: the 8x VAE's
    cfg = {"trainer": {"devices": 1},
           "model": {"class_path": "posttrain.lit.finetune.Finetune",
                     "init_args": {"card": {"experts": {"text_encoder": text, "vae": vae,
                                                        "transformer": expert},
                                            "text_max_length": s["text_len"]},
                                   "run": {"frames": s["frames"], "height": s["height"], "width": s["width"]}}},
           "data": {"class_path": "posttrain.datamodules.synthetic.SyntheticVideos",
                    "init_args": {"batch_size": s["batch"]}}}
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "gpu.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f)
        result = estimate(path)["transformer"]
        return result.device_bytes, result.model_state_bytes, result.host_bytes


# ---------------------------------------------------------------------- 2. flow_grpo, K = 8
def flow_grpo_step(s: dict, device: Device, checkpointing: bool, K: int = 8, decode: bool = True) -> dict:
    """One prompt's group of K through a card and its generator stage, as flow_grpo runs it: SDE rollout (one
    batched forward per step, log p captured), VAE decoding, PPO-clip update on half the SDE steps (each
    step's loss backed up before the next, one optimizer step)."""
    device.reset_peak()
    card = built_card(s, device, Expert(
        arch="wan_t2v", preset=dict(s["config"]), trainable=True, grad_clip=1.0,
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-5, weight_decay=0.0), gradient_checkpointing=checkpointing))
    stage = GeneratorStage(card)
    model = card["transformer"]
    optimizer = torch.optim.AdamW(card.parameters_of("transformer"), lr=1e-5, weight_decay=0.0,
                                  fused=device.cuda or None)
    sampler = FlowMatchSampler(num_steps=s["rl_steps"])
    shape = stage.latent_shape(VideoSize(s["rl_frames"], s["rl_height"], s["rl_width"]))
    g = torch.Generator().manual_seed(0)
    cond = stage.condition(["a red circle moving left on a blue background"] * K, torch.device(device.name))
    parts: dict[str, list[float]] = {"rollout": [], "decode": [], "update": []}

    syncs: list[int] = []

    def iteration():
        start = time.perf_counter()
        with autocast(device), host_syncs(device) as caught:
            rollout = Rollout.sample(stage, sampler, cond, None, shape, g)
        syncs.append(len(caught))
        device.sync()
        parts["rollout"].append(time.perf_counter() - start)
        start = time.perf_counter()
        if decode:
            with torch.no_grad():
                stage.decode(rollout.latents)
        device.sync()
        parts["decode"].append(time.perf_counter() - start)
        start = time.perf_counter()
        advantages = torch.randn(K, generator=g).to(device.name)
        steps = train_steps(sampler, 0.5, g)
        for loss in rollout.step_losses(steps, advantages, clip_range=0.2, kl_beta=0.0):
            with autocast(device):
                value = loss()
            value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        device.sync()
        parts["update"].append(time.perf_counter() - start)

    iterations = max(2, s["iterations"] - 1)
    timed(device, iteration, iterations)
    for values in parts.values():
        del values[0]  # the warm-up iteration
    peak, how = device.peak_bytes(model)
    medians = {k: median(v) for k, v in parts.items()}
    result = dict(K=K, sde_steps=s["rl_steps"], trained_steps=math.ceil(0.5 * s["rl_steps"]),
                  video=f"{s['rl_frames']}x{s['rl_height']}x{s['rl_width']}", seconds=medians,
                  seconds_per_iteration=sum(medians.values()), peak_bytes=peak, peak_kind=how,
                  rollout_host_syncs=syncs[-1] if device.cuda else None)
    return result


@contextlib.contextmanager
def host_syncs(device: Device):
    """The host synchronisations CUDA reports inside the block (``torch.cuda.set_sync_debug_mode("warn")``: one
    warning per ``.item()``, ``.cpu()``, ``nonzero``… on a device tensor); none are looked for on a CPU."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device.cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            if device.cuda:
                torch.cuda.set_sync_debug_mode("default")
    caught[:] = [w for w in caught if "synchroniz" in str(w.message)]


# ---------------------------------------------------------------------- serving: 3. and 4.
def serving_stage(s: dict, device: Device, arch: str) -> GeneratorStage:
    """A generator stage that serves on ``device``: the ``arch`` transformer at the bench's shape, in the VAE's
    serving dtype."""
    return GeneratorStage(built_card(s, device, Expert(arch=arch, preset=dict(s["config"]),
                                                       dtype=vae_dtype(s["config"] is TINY))))


# ---------------------------------------------------------------------- 3. the causal student's generation rate
def causal_generation(s: dict, device: Device) -> dict:
    """Self-Forcing's serving: the block-causal student (``wan_t2v_causal`` at the transformer's shape) generates
    one finetune-sized video chunk by chunk (``causal_chunk`` latent frames a chunk, Self-Forcing's 3 at full size;
    4 re-noised steps σ ∈ {1, .75, .5, .25}; each finished chunk run once more at σ = 0 to fill the KV cache),
    through the package's own path (``GeneratorStage.sample`` with ``chunk_frames``), then the VAE decodes it.
    Frames per second = video frames / seconds, without and with decoding (the anchor: 17 FPS for Wan2.1-1.3B
    chunk-wise on one H100, decoding included)."""
    device.reset_peak()
    stage = serving_stage(s, device, "wan_t2v_causal")
    sampler = FlowMatchSampler(num_steps=4, step_sigmas=[1.0, 0.75, 0.5, 0.25], chunk_frames=s["causal_chunk"],
                               scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0, stochastic_sampling=True))
    shape = stage.latent_shape(VideoSize(s["frames"], s["height"], s["width"]))
    cond = stage.condition(["a red circle moving left on a blue background"], torch.device(device.name))
    g = torch.Generator().manual_seed(0)
    latents: list[torch.Tensor] = []

    def generate():
        noise = torch.randn((1, *shape), generator=g).to(device.name)
        with autocast(device):
            latents.append(stage.sample(sampler, noise, cond, rng=g).latents)

    def generate_and_decode():
        generate()
        with torch.no_grad():
            stage.decode(latents.pop())

    generation = median(timed(device, generate, s["iterations"]))
    latents.clear()
    with_decode = median(timed(device, generate_and_decode, s["iterations"]))
    peak, how = device.peak_bytes()
    return dict(video=f"{s['frames']}x{s['height']}x{s['width']}", latent_frames=shape[1],
                chunk_frames=s["causal_chunk"], chunks=shape[1] // s["causal_chunk"], steps=4,
                seconds=generation, seconds_with_decode=with_decode, fps=s["frames"] / generation,
                fps_with_decode=s["frames"] / with_decode, peak_bytes=peak, peak_kind=how)


# ---------------------------------------------------------------------- 4. few-step students vs their teacher
DMD2_CONFIG = os.path.join(ROOT, "configs", "dmd2.yaml")


def dmd2_samplers(config: str = DMD2_CONFIG) -> tuple[FlowMatchSampler, FlowMatchSampler]:
    """(the student's sampler, the teacher's) as ``config`` writes them, built by jsonargparse alone: the bench
    times what the config serves, and follows it when it changes."""
    import yaml
    from jsonargparse import ArgumentParser

    with open(config) as f:
        init = yaml.safe_load(f)["model"]["init_args"]
    parser = ArgumentParser(exit_on_error=False)
    for key in ("sampler", "teacher_sampler"):
        parser.add_subclass_arguments(FlowMatchSampler, key)
    built = parser.instantiate(parser.parse_object({key: init[key] for key in ("sampler", "teacher_sampler")}))
    return built.sampler, built.teacher_sampler


def few_step_sampling(s: dict, device: Device) -> dict:
    """DMD2's serving claim at the transformer's real shape: one finetune-sized video sampled by the teacher as
    ``configs/dmd2.yaml``'s ``teacher_sampler`` runs it (many steps with CFG: the conditional and unconditional rows
    in one batched forward a step, as ``FlowMatchSampler`` does) and by students of 1, 2 and 4 steps (the config's
    re-noised step lists, one forward a step, no CFG), through ``GeneratorStage.sample``; the VAE's decode is timed
    apart. Speed-up = (teacher's sampling + decode) / (student's sampling + decode); decode share = decode / the
    student's whole."""
    device.reset_peak()
    stage = serving_stage(s, device, "wan_t2v")
    frames, height, width = s.get("fewstep_video") or (s["frames"], s["height"], s["width"])
    shape = stage.latent_shape(VideoSize(frames, height, width))
    prompt = ["a red circle moving left on a blue background"]

    student, teacher_sampler = dmd2_samplers()

    def teacher(steps: int) -> FlowMatchSampler:  # the config's teacher sampler at ``steps`` steps
        return FlowMatchSampler(num_steps=steps, guidance_scale=teacher_sampler.guidance_scale,
                                scheduler=teacher_sampler.scheduler)

    students = {n: student_sampler(student, n) for n in (1, 2, 4)}  # DMD2's step lists, as the config shifts them
    g = torch.Generator().manual_seed(0)
    latents: list[torch.Tensor] = []

    def sampling(sampler: FlowMatchSampler) -> Callable[[], None]:
        cond, uncond = stage.conditioning(prompt, sampler.guidance_scale, torch.device(device.name))

        def fn():
            noise = torch.randn((1, *shape), generator=g).to(device.name)
            with autocast(device):
                latents[:] = [stage.sample(sampler, noise, cond, uncond, rng=g).latents]
        return fn

    repeats = s["fewstep_repeats"]
    out: dict[str, Any] = dict(video=f"{frames}x{height}x{width}", latent_shape=list(shape))
    # the teacher's kernels warmed by a 2-step pass of the same batched-CFG shape: at full size one teacher sample
    # takes tens of seconds, a warm-up of its own would double that
    timed(device, sampling(teacher(2)), 0)
    steps = teacher_sampler.num_steps
    out["teacher"] = dict(steps=steps, guidance_scale=teacher_sampler.guidance_scale,
                          seconds=median(timed(device, sampling(teacher(steps)), s["teacher_repeats"], warmup=0)))
    with torch.no_grad():
        out["decode_seconds"] = median(timed(device, lambda: stage.decode(latents[0]), repeats))
    teacher_whole = out["teacher"]["seconds"] + out["decode_seconds"]
    for n, sampler in students.items():
        seconds = median(timed(device, sampling(sampler), repeats))
        whole = seconds + out["decode_seconds"]
        out[f"student_{n}"] = dict(steps=n, seconds=seconds, speedup=teacher_whole / whole,
                                   speedup_without_decode=out["teacher"]["seconds"] / seconds,
                                   decode_share=out["decode_seconds"] / whole)
    out["peak_bytes"], out["peak_kind"] = device.peak_bytes()
    return out


# ---------------------------------------------------------------------- which attention kernel runs
def attention_kernels(s: dict, device: Device) -> dict:
    """The kernels one bf16 forward of the transformer launches for attention (``torch.profiler``): flash,
    memory-efficient, cuDNN or the math fallback of ``scaled_dot_product_attention``; on a CPU, the CPU kernel."""
    from torch.profiler import ProfilerActivity, profile

    model = build_plain(s["config"], device, checkpointing=False).eval()
    g = torch.Generator().manual_seed(0)
    x0, noise, cond, sigma = finetune_batch(s, device, g)
    x, t = noised(x0, noise, sigma), timestep_of(sigma)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.cuda else [])
    with torch.no_grad(), autocast(device), profile(activities=activities) as prof:
        WAN.velocity(model, x, t, cond)
    names = sorted({e.key for e in prof.key_averages()
                    if any(k in e.key.lower() for k in ("flash", "efficient", "cudnn", "fmha", "attention"))})
    del model
    return dict(kernels=names)


# ---------------------------------------------------------------------- main
def run(tiny: bool, device_name: str, checkpointing: bool, skip: set[str], peak_tflops: Optional[float],
        partial: Optional[str] = None, fewstep_video: Optional[tuple[int, int, int]] = None) -> dict:
    device = Device(device_name)
    begun = time.perf_counter()
    s = dict(sizes(tiny), fewstep_video=fewstep_video)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.cuda else "cpu",
                           "shape": "tiny" if tiny else "Wan2.1-T2V-1.3B", "gradient_checkpointing": checkpointing,
                           "finetune_video": f"{s['frames']}x{s['height']}x{s['width']}", "batch": s["batch"]}
    tflops = device.peak_tflops(peak_tflops)
    parts = {
        "fewstep": lambda: few_step_sampling(s, device),
        "plain": lambda: finetune_plain(s, device, checkpointing, tflops),
        "zero3": lambda: finetune_zero3(s, device, False, checkpointing, tflops),
        "rl": lambda: flow_grpo_step(s, device, checkpointing),
        "causal": lambda: causal_generation(s, device),
        "attention": lambda: attention_kernels(s, device),
        "offload": lambda: finetune_zero3(s, device, True, checkpointing, tflops),
    }
    for name, fn in parts.items():
        if name in skip:
            continue
        try:
            out[name] = fn()
        except Exception as err:  # one part failing (e.g. out of memory) must not lose the others' figures
            out[name] = {"error": f"{type(err).__name__}: {str(err)[:500]}"}
            traceback.print_exc()
        device.reset_peak()
        if partial:  # each part's figures kept as it ends: a run stopped at its time limit loses only the rest
            with open(partial, "w") as f:
                json.dump(out, f, indent=1)
        print(f"  [{name} done, {time.perf_counter() - begun:.0f} s]", flush=True)
    return out


def video_size(text: str) -> tuple[int, int, int]:
    """``FxHxW`` (e.g. ``81x480x832``) as (frames, height, width); anything else is a ValueError."""
    frames, height, width = (int(v) for v in text.lower().split("x"))
    return frames, height, width


def size(b: Optional[int]) -> str:
    if b is None:
        return "n/a"
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def report(out: dict) -> str:
    lines = [f"bench/gpu.py on {out['device']}: {out['shape']} transformer, bf16, gradient checkpointing "
             f"{'on' if out['gradient_checkpointing'] else 'off'}; finetune video {out['finetune_video']}, "
             f"batch {out['batch']}"]
    names = {"plain": "finetune, plain (fp32 master, bf16 autocast)", "zero3": "finetune, ZeRO-3 bf16",
             "offload": "finetune, ZeRO-3 bf16 + offload opt/params"}
    for key, label in names.items():
        r = out.get(key)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"  {label:<44}: {r['error']}")
            continue
        text = (f"  {label:<44}: {r['seconds_per_iteration']:.3f} s/iteration, peak {size(r['peak_bytes'])} "
                f"({r['peak_kind']})")
        if "mfu" in r:
            text += f", {r['model_tflops_per_iteration']:.1f} model TFLOP/iteration, MFU {r['mfu']:.1%}"
        if r.get("estimate_bytes") is not None:
            text += (f"; lit.estimate {size(r['estimate_bytes'])} (model states "
                     f"{size(r['estimate_model_state_bytes'])}, host {size(r['estimate_host_bytes'])})")
        lines.append(text)
    r = out.get("rl")
    if r is not None:
        if "error" in r:
            lines.append(f"  flow_grpo step: {r['error']}")
        else:
            sec = r["seconds"]
            peak = size(r["peak_bytes"])
            lines.append(f"  flow_grpo step, K={r['K']}, {r['video']}, {r['sde_steps']} SDE steps, {r['trained_steps']} "
                         f"trained: rollout {sec['rollout']:.3f} s + decode {sec['decode']:.3f} s + update "
                         f"{sec['update']:.3f} s = {r['seconds_per_iteration']:.3f} s; peak {peak}; host syncs "
                         f"in the rollout: {'n/a on a CPU' if r['rollout_host_syncs'] is None else r['rollout_host_syncs']}")
    r = out.get("causal")
    if r is not None:
        if "error" in r:
            lines.append(f"  causal student: {r['error']}")
        else:
            lines.append(f"  causal student, {r['video']} ({r['chunks']} chunks of {r['chunk_frames']} latent frames, "
                         f"{r['steps']} steps, KV cache): {r['seconds']:.3f} s = {r['fps']:.1f} FPS; with VAE "
                         f"decoding {r['seconds_with_decode']:.3f} s = {r['fps_with_decode']:.1f} FPS")
    r = out.get("fewstep")
    if r is not None:
        if "error" in r:
            lines.append(f"  few-step students: {r['error']}")
        else:
            t = r["teacher"]
            lines.append(f"  few-step sampling, {r['video']}: teacher {t['steps']} steps CFG {t['guidance_scale']} "
                         f"{t['seconds']:.3f} s + decode {r['decode_seconds']:.3f} s")
            for n in (1, 2, 4):
                st = r[f"student_{n}"]
                lines.append(f"    student {n} step{'s' if n > 1 else ''}: {st['seconds']:.3f} s + decode: "
                             f"x{st['speedup']:.1f} the teacher's speed (x{st['speedup_without_decode']:.1f} without "
                             f"decode); decode is {st['decode_share']:.0%} of its time")
    r = out.get("attention")
    if r is not None:
        lines.append(f"  attention kernels: {r.get('error') or ', '.join(r['kernels']) or 'none matched'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (or --device)")
    parser.add_argument("--device", default=None, help="default: cuda if available (cpu with --tiny)")
    parser.add_argument("--no-checkpointing", action="store_true", help="gradient checkpointing off")
    parser.add_argument("--skip", nargs="*", default=[], choices=["fewstep", "plain", "zero3", "offload", "rl", "causal",
                                                                   "attention"])
    parser.add_argument("--fewstep-video", default=None, metavar="FxHxW",
                        help="the few-step part's video (default: the finetune's, 81x480x832 at full size)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak")
    parser.add_argument("--out", default="runs/bench_gpu/gpu.json", help="figures as JSON")
    args = parser.parse_args()
    device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device == "cpu" and not args.tiny:
        parser.error("no GPU here: the 1.3B shape needs one; run with --tiny for the CPU check")
    if device == "cpu":
        torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    video = None
    if args.fewstep_video:
        try:
            video = video_size(args.fewstep_video)
        except ValueError:
            parser.error(f"--fewstep-video {args.fewstep_video!r}: give frames x height x width, e.g. 33x480x832")
    out = run(args.tiny, device, not args.no_checkpointing, set(args.skip), args.peak_tflops, partial=args.out,
              fewstep_video=video)
    print(report(out))
    write_figures(args.out, out)


def write_figures(path: str, figures: Any) -> None:
    """A bench's figures as JSON at ``path`` (its folder made), and a line saying where."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(figures, f, indent=1)
    print(f"figures written to {path}")


if __name__ == "__main__":
    main()
