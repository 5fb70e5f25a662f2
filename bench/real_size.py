"""The published architectures at real size, random weights, real training iterations: do they build, train, fit
in the memory ``posttrain estimate`` says, and how large is what a checkpoint keeps?

Each case builds its generator as an expert of a card (``Expert.published``: the published config, random weights
from a fixed seed, filled module by module; ``modules/models/published.py``) and trains it for ``--iterations``
flow-matching iterations at a small size through the package's generator adapter (the call every method makes),
bf16 autocast, gradient checkpointing, AdamW on what trains. The text conditioning is random rows of the
published text encoder's width (cached text embeddings: the text encoder is never built) and the clean latents
random (the VAE is not run). Every case runs in its own process; it prints:

- **parameters** of the generator, and those that train;
- **peak RSS** of its process (``resource.getrusage(RUSAGE_SELF).ru_maxrss``: build, iterations and checkpoint), and
  how much of it the run added above the interpreter and its libraries before the build (``VmRSS`` then): what the
  estimate's ``transformer`` row is compared with (the ratio printed beside it);
- **estimate**: ``posttrain estimate``'s figure for the same expert (``lit.tools.estimate.estimate`` on a
  config of this size; its ``transformer`` row: weights, gradients, optimizer state, activations);
- **checkpoint**: the bytes of what a checkpoint keeps of it (what trains and its AdamW state, ``torch.save``; a
  published or pretrained base is rebuilt from its source on resume);
- **s/iteration**: the median over the iterations after the first (the first creates the optimizer state).

Cases: ``wan1.3b_full`` (Wan2.1-T2V-1.3B full finetune, bf16 weights and AdamW state), ``wan1.3b_lora`` (bf16
base, LoRA rank 32 in float32), ``wan14b_lora_fp8`` (Wan2.1-T2V-14B, LoRA on an fp8 base: ``Expert.fp8``),
``wan5b_ti2v_lora`` (Wan2.2-TI2V-5B, bf16 base, LoRA rank 32, text-to-video: 5 frames × 128×128 through its 16x
VAE, latents 2×8×8, 32 tokens), ``flux_lora_fp8`` (FLUX.1-dev, LoRA on an fp8 base, one 128×128 image),
``qwen_image_lora_fp8`` (Qwen-Image, LoRA on an fp8 base, one 128×128 image, its text under a mask). Wan trains on
5 frames × 64×64 (latents 2×8×8, 32 tokens), FLUX and Qwen-Image on 128×128 (16×16 latents, 64 packed tokens), 512
text tokens each.

    python -m bench.real_size --cases wan1.3b_lora               # ~3.5 GiB RSS on the CPU
    python -m bench.real_size --layers 1                         # every case, published widths, one block each
    python -m bench.real_size                                    # every case at full depth: ~16-20 GiB RAM
    python -m bench.real_size --device cuda --cases wan1.3b_lora --video 81x480x832 --iterations 10   # one GPU

``--device cuda`` adds peak GPU memory (``torch.cuda.max_memory_allocated``) and MFU = model FLOPs per iteration /
seconds per iteration / the card's dense bf16 peak (``bench/gpu.py``'s table, or ``--peak-tflops``). Model FLOPs
= 3 x the transformer forward's FLOPs as ``torch.utils.flop_counter`` counts them (every matmul and attention
product, 2 FLOPs per multiply-add; backward = 2 x forward), about 3 x (2·N·T + 4·L·T²·d) for N parameters, T
tokens, L blocks of width d. With gradient checkpointing the recomputed forward is work done but not model FLOPs:
it is in HFU (4 x the forward), printed beside. ``--pretrained FOLDER`` trains the folder's weights instead of
random ones. ``--swap-blocks N`` keeps the frozen weights of each case's last N blocks in host memory
(``Expert.swap_blocks``): on the CPU host and device are one memory, so it shows the path runs at real size, not a
saving; on a GPU the peak drops by all but two of those blocks. ``bench/gpu_real_size.sh`` runs the 1.3B LoRA case
at 81 x 480 x 832 on one H100/H200, then Wan2.1-14B LoRA (fp8 base, 24 of 40 blocks swapped) at the same size.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
import yaml

from bench.gpu import Device, forward_flops, median, size, video_size, write_figures

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Case:
    """One published generator and how it trains here."""

    published: str
    arch: str
    lora: bool
    fp8: bool
    frames: int
    height: int
    width: int
    layer_keys: tuple[str, ...]  # what --layers sets
    text_length: int = 512
    note: str = ""
    pretrained: Optional[str] = None  # a diffusers folder whose `transformer` to train instead of random weights
    vae: str = "wan_vae"  # the published VAE's arch, and its spatial compression (the latents' h, w)
    spatial: int = 8
    swap_blocks: int = 0  # Expert.swap_blocks: the frozen weights of the last N blocks in host memory (--swap-blocks)


LORA = dict(rank=32, alpha=32.0, target_modules=["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"])
FLUX_LORA = dict(rank=32, alpha=32.0, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
QWEN_IMAGE_LORA = dict(rank=32, alpha=32.0, target_modules=[  # configs/recipes/qwen_image_lora.yaml's
    "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "img_mlp.net.0.proj",
    "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"])
CASES = {
    "wan1.3b_full": Case("Wan2.1-T2V-1.3B", "wan_t2v", lora=False, fp8=False, frames=5, height=64, width=64,
                         layer_keys=("num_layers",), note="full finetune, bf16 weights and AdamW state"),
    "wan1.3b_lora": Case("Wan2.1-T2V-1.3B", "wan_t2v", lora=True, fp8=False, frames=5, height=64, width=64,
                         layer_keys=("num_layers",), note="LoRA rank 32, bf16 base"),
    "wan14b_lora_fp8": Case("Wan2.1-T2V-14B", "wan_t2v", lora=True, fp8=True, frames=5, height=64, width=64,
                            layer_keys=("num_layers",), note="LoRA rank 32, fp8 base, cached text embeddings"),
    "wan5b_ti2v_lora": Case("Wan2.2-TI2V-5B", "wan22_ti2v", lora=True, fp8=False, frames=5, height=128, width=128,
                            layer_keys=("num_layers",), vae="wan22_vae", spatial=16,
                            note="LoRA rank 32, bf16 base, one timestep per token"),
    "flux_lora_fp8": Case("FLUX.1-dev", "flux", lora=True, fp8=True, frames=1, height=128, width=128,
                          layer_keys=("num_layers", "num_single_layers"), note="LoRA rank 32, fp8 base, one image"),
    "qwen_image_lora_fp8": Case("Qwen-Image", "qwen_image", lora=True, fp8=True, frames=1, height=128, width=128,
                                layer_keys=("num_layers",), vae="qwen_image_vae",
                                note="LoRA rank 32, fp8 base, one image, masked text"),
}


def expert_settings(case: Case, layers: Optional[int], checkpointing: bool = True) -> dict[str, Any]:
    """The generator expert of ``case`` as a card's YAML writes it (``--layers``: ``preset`` overrides)."""
    source = ({"pretrained": case.pretrained, "subfolder": "transformer"} if case.pretrained
              else {"published": case.published})
    settings: dict[str, Any] = dict(arch=case.arch, **source, dtype="bfloat16", trainable=True,
                                    gradient_checkpointing=checkpointing)
    if layers is not None:
        settings["preset"] = {key: layers for key in case.layer_keys}
    if case.lora:
        settings["lora"] = {"flux": FLUX_LORA, "qwen_image": QWEN_IMAGE_LORA}.get(case.arch, LORA)
    if case.fp8:
        settings["fp8"] = True
    if case.swap_blocks:
        settings["swap_blocks"] = case.swap_blocks
    return settings


def expert(case: Case, layers: Optional[int], checkpointing: bool = True):
    """``case``'s generator as an ``Expert`` (``expert_settings``), with its AdamW."""
    from posttrain.modules.models.cards import Expert, LoraConfig

    settings = expert_settings(case, layers, checkpointing)
    lora = settings.pop("lora", None)
    return Expert(**settings, lora=LoraConfig(**lora) if lora else None,
                  optimizer=functools.partial(torch.optim.AdamW, lr=1e-4, weight_decay=0.01))


def build(case: Case, layers: Optional[int], device: str, checkpointing: bool = True):
    """The card holding ``case``'s generator, built (random weights from the published seed) and on ``device``."""
    from posttrain.modules.models.cards import ModelCard

    card = ModelCard({"transformer": expert(case, layers, checkpointing)}, text_max_length=case.text_length)
    card.build()
    if case.swap_blocks:  # before the card moves, as a run swaps them (ExpertModule.configure_model)
        card.swap("transformer", torch.device(device))
    card.to(device)
    return card


def batch(case: Case, model: torch.nn.Module, device: str, g: torch.Generator):
    """Random clean latents, noise, σ and cached text conditioning of one sample of ``case``."""
    from posttrain.modules.flow.conditioning import Conditioning
    from posttrain.modules.flow.losses import sample_sigmas

    config = model.config
    if case.arch == "flux":  # 8x VAE, 16 channels, one frame; T5 rows, CLIP's pooled vector, embedded guidance
        shape = (16, 1, case.height // 8, case.width // 8)
        cond = dict(encoder_hidden_states=(case.text_length, config.joint_attention_dim),
                    pooled_projections=(config.pooled_projection_dim,))
    elif case.arch == "qwen_image":  # 8x VAE, 16 channels, one frame; Qwen2.5-VL rows (their mask below)
        shape = (16, 1, case.height // 8, case.width // 8)
        cond = dict(encoder_hidden_states=(case.text_length, config.joint_attention_dim))
    else:  # Wan's VAE: 8x spatial (Wan 2.2's: 16x), 4x temporal; UMT5 rows
        shape = (config.out_channels, (case.frames - 1) // 4 + 1, case.height // case.spatial,
                 case.width // case.spatial)
        cond = dict(encoder_hidden_states=(case.text_length, config.text_dim))
    x0 = torch.randn((1, *shape), generator=g).to(device)
    noise = torch.randn(x0.shape, generator=g).to(device)
    conditioning = {name: torch.randn((1, *s), generator=g).to(device, torch.bfloat16) for name, s in cond.items()}
    if getattr(config, "guidance_embeds", False):
        conditioning["guidance"] = torch.full((1,), 3.5, device=device)
    if case.arch == "qwen_image":  # every text token valid: the longest prompt of encode_prompt's batch
        conditioning["encoder_hidden_states_mask"] = torch.ones((1, case.text_length), dtype=torch.long, device=device)
    return x0, noise, sample_sigmas(1, "logit_normal", g).to(device), Conditioning(conditioning)


def run_case(name: str, iterations: int = 2, layers: Optional[int] = None, device: str = "cpu",
             checkpointing: bool = True, out: Optional[str] = None,
             peak_tflops: Optional[float] = None) -> dict[str, Any]:
    """Build case ``name`` and train it for ``iterations`` iterations in this process; its figures (peak RSS of
    this process so far)."""
    from posttrain.modules.flow.losses import flow_matching_loss, noised
    from posttrain.modules.flow.samplers import FlowMatchSampler
    from posttrain.modules.models.generators import ADAPTERS

    case = CASES[name]
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    baseline = rss_now()  # the interpreter and its libraries, before any model: what the estimate does not count
    start = time.perf_counter()
    card = build(case, layers, device, checkpointing)
    build_seconds = time.perf_counter() - start
    model = card["transformer"].train()
    adapter = ADAPTERS[case.arch]
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = card.optimizer_for("transformer", trainable)
    g = torch.Generator().manual_seed(0)
    timestep_of = FlowMatchSampler().timestep_of
    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16)

    def step() -> float:
        x0, noise, sigma, cond = batch(case, model, device, g)
        with autocast:
            v = adapter.velocity(model, noised(x0, noise, sigma), timestep_of(sigma), cond)
        loss = flow_matching_loss(v.float(), x0, noise)[0].mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    times, losses = [], []
    for _ in range(iterations):
        begin = time.perf_counter()
        losses.append(step())
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
    result = dict(case=name, published=case.published, note=case.note, layers=layers, device=device,
                  params=sum(p.numel() for p in model.parameters()), trainable=sum(p.numel() for p in trainable),
                  build_seconds=build_seconds, seconds_per_iteration=median(times[1:] or times), times=times,
                  losses=losses, checkpoint_bytes=checkpoint_bytes(model, optimizer, out))
    if device.startswith("cuda"):
        result["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
        x0, noise, sigma, cond = batch(case, model, device, g)
        forward = forward_flops(model, noised(x0, noise, sigma), timestep_of(sigma), cond, autocast, adapter)
        result["tflops_per_iteration"] = 3 * forward / 1e12  # model FLOPs: forward + backward
        if peak_tflops:
            per_second = result["seconds_per_iteration"] * peak_tflops * 1e12
            result["mfu"] = 3 * forward / per_second
            result["hfu"] = (4 if checkpointing else 3) * forward / per_second  # with the recomputed forward
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    result["baseline_rss_bytes"] = baseline
    return result


def rss_now() -> int:
    """This process's resident memory now (``VmRSS``), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def checkpoint_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, out: Optional[str]) -> int:
    """Bytes of what a checkpoint keeps of the expert: its trained parameters and their optimizer state (a
    published or pretrained base is rebuilt from its source on resume), written with ``torch.save``."""
    state = {"weights": {k: p.detach() for k, p in model.named_parameters() if p.requires_grad},
             "optimizer": optimizer.state_dict()}
    with tempfile.TemporaryDirectory(dir=out) as folder:
        path = os.path.join(folder, "expert.pt")
        torch.save(state, path)
        return os.path.getsize(path)


# ---------------------------------------------------------------------- the estimate beside it
def estimate_config(case: Case, layers: Optional[int], folder: str, checkpointing: bool = True) -> str:
    """A ``Finetune`` config of the case's size whose ``transformer`` is the case's expert (frozen tiny encoders and
    the published VAE beside it, which the estimate's ``transformer`` row does not count)."""
    expert = expert_settings(case, layers, checkpointing)
    expert["optimizer"] = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-4, "weight_decay": 0.01}}
    if case.arch == "flux":
        encoders = {"text_encoder": {"arch": "clip", "preset": {"hidden_size": 768, "projection_dim": 768}},
                    "text_encoder_2": {"arch": "t5", "preset": {"d_model": 4096}},
                    "vae": {"arch": "vae_kl", "published": case.published}}
    elif case.arch == "qwen_image":  # built on the meta device only
        encoders = {"text_encoder": {"arch": "qwen2_5_vl", "published": case.published},
                    "vae": {"arch": case.vae, "published": case.published}}
    else:
        encoders = {"text_encoder": {"arch": "umt5", "preset": {"d_model": 4096}},
                    "vae": {"arch": case.vae, "published": case.published}}
    config = {
        "trainer": {"accelerator": "cpu", "devices": 1, "precision": "bf16-mixed", "max_steps": 1},
        "model": {"class_path": "posttrain.lit.Finetune", "init_args": {
            "card": {"experts": {**encoders, "transformer": expert}, "text_max_length": case.text_length},
            "run": {"frames": case.frames, "height": case.height, "width": case.width}}},
        "data": {"class_path": "posttrain.datamodules.SyntheticVideos", "init_args": {"batch_size": 1}},
    }
    path = os.path.join(folder, f"{case.published}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path


def estimated_bytes(name: str, layers: Optional[int], checkpointing: bool = True,
                    device: str = "cpu") -> tuple[Optional[int], str]:
    """``posttrain estimate``'s device bytes for the case's ``transformer`` (None and why, where it cannot say). With
    swapped blocks on the CPU, host and device are one memory: the swapped blocks are added back (the two resident
    ones are the host copies themselves there)."""
    from posttrain.lit.tools.estimate import estimate, meta_model, swapped_block_bytes

    case = CASES[name]
    with tempfile.TemporaryDirectory() as folder:
        try:
            table = estimate(estimate_config(case, layers, folder, checkpointing), devices=1)
            row = table["transformer"]
        except Exception as err:  # noqa: BLE001 - the bench reports the rest
            return None, f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    spec = expert(case, layers, checkpointing)
    model = meta_model(spec)
    built = sum(p.numel() for p in model.parameters())
    if row.params != built:  # the estimate built another model than the bench trains (published not read)
        return None, f"estimate counted {row.params:,} parameters, the bench builds {built:,}"
    if case.swap_blocks and not device.startswith("cuda"):
        swapped, resident = swapped_block_bytes(spec, model)
        return row.device_bytes + swapped - resident, "swapped blocks counted: the CPU is host and device"
    return row.device_bytes, ""


# ---------------------------------------------------------------------- one process per case
def in_child(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Case ``name`` in a fresh process (its peak RSS its own); its figures, or its error."""
    command = [sys.executable, "-m", "bench.real_size", "--child", name, "--iterations", str(args.iterations),
               "--device", args.device]
    command += ["--layers", str(args.layers)] if args.layers is not None else []
    command += ["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else []
    command += ["--no-checkpointing"] if args.no_checkpointing else []
    command += ["--pretrained", args.pretrained] if args.pretrained else []
    command += ["--swap-blocks", str(args.swap_blocks)] if args.swap_blocks else []
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(case=name, error=f"exit {done.returncode}: {tail[:300]}")
    return json.loads(lines[-1])


def row(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"  {r['case']:<16} {r['error']}"
    model = r["peak_rss_bytes"] - r.get("baseline_rss_bytes", 0)  # what the run added to the bare interpreter
    ratio = f" = {r['estimate_bytes'] / model:.2f} x" if r.get("estimate_bytes") and model > 0 else ""
    text = (f"  {r['case']:<16} {r['params'] / 1e9:6.3f}B params ({r['trainable'] / 1e6:.1f}M train), peak RSS "
            f"{size(r['peak_rss_bytes'])} ({size(model)} above the {size(r.get('baseline_rss_bytes'))} of the "
            f"interpreter before the build), estimate {size(r.get('estimate_bytes'))}{ratio}"
            f"{' (' + r['estimate_note'] + ')' if r.get('estimate_note') else ''}, checkpoint "
            f"{size(r['checkpoint_bytes'])}, {r['seconds_per_iteration']:.2f} s/iteration (build "
            f"{r['build_seconds']:.0f} s)")
    if "peak_gpu_bytes" in r:
        text += f", peak GPU {size(r['peak_gpu_bytes'])}, {r['tflops_per_iteration']:.1f} TFLOP/iteration"
        text += f", MFU {r['mfu']:.1%} (HFU {r['hfu']:.1%})" if "mfu" in r else ""
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--layers", type=int, default=None, help="the published widths with only N blocks")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--video", default=None, metavar="FxHxW", help="override the cases' size (e.g. 81x480x832)")
    parser.add_argument("--no-checkpointing", action="store_true", help="gradient checkpointing off")
    parser.add_argument("--pretrained", default=None, metavar="FOLDER",
                        help="a diffusers folder of the case's model: train its transformer's weights")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak (cuda)")
    parser.add_argument("--out", default="runs/bench_real_size/real_size.json", help="figures as JSON")
    parser.add_argument("--swap-blocks", type=int, default=0, metavar="N",
                        help="the frozen weights of the last N blocks in host memory (Expert.swap_blocks)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    cases = [args.child] if args.child else args.cases
    if args.video:
        try:
            frames, height, width = video_size(args.video)
        except ValueError:
            parser.error(f"--video {args.video!r}: give frames x height x width, e.g. 81x480x832")
        for name in cases:
            CASES[name] = replace(CASES[name], frames=frames, height=height, width=width)
    if args.pretrained:
        if not os.path.isdir(os.path.join(args.pretrained, "transformer")):
            parser.error(f"--pretrained {args.pretrained!r}: no transformer/ folder there")
        for name in cases:
            CASES[name] = replace(CASES[name], pretrained=args.pretrained)
    if args.swap_blocks:
        for name in cases:
            CASES[name] = replace(CASES[name], swap_blocks=args.swap_blocks)
    args.peak_tflops = Device(args.device).peak_tflops(args.peak_tflops)  # the card's, on a GPU
    if args.child:
        result = run_case(args.child, args.iterations, args.layers, args.device, not args.no_checkpointing,
                          peak_tflops=args.peak_tflops)
        print(json.dumps(result), flush=True)
        return
    results = []
    print(f"bench/real_size.py on {args.device}: random weights (published configs"
          f"{f', {args.layers} block(s) each' if args.layers else ''}), {args.iterations} iterations", flush=True)
    for name in args.cases:
        if args.video or args.device != "cpu":
            result = run_case(name, args.iterations, args.layers, args.device, not args.no_checkpointing,
                              peak_tflops=args.peak_tflops)
        else:
            result = in_child(name, args)
        if "error" not in result:
            result["estimate_bytes"], result["estimate_note"] = estimated_bytes(name, args.layers,
                                                                                not args.no_checkpointing, args.device)
        results.append(result)
        print(row(result), flush=True)
    write_figures(args.out, results)


if __name__ == "__main__":
    main()
