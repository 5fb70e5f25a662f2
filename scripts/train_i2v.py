"""Pretrain the Wan image-to-video stage of the world: a ``wan_i2v`` transformer animating a first frame.

Flow matching (rectified flow, logit-normal σ, 10% caption dropout for CFG) on the world VAE's latents of
the world's videos, each conditioned on its own first frame exactly as ``WanImageToVideoPipeline`` builds
the condition (``WanI2V.image``: the VAE latents of [first frame, zeros] and the first-frame mask, concatenated
on channels) and on its caption through the world's UMT5 (frozen: the I2V model reads the text stack the
world's text-to-video generator was trained with, as Wan's I2V and T2V models share one). The transformer
starts from the world's text-to-video weights where shapes agree (the real Wan I2V models start from T2V):
the patch embedding's first 16 input channels copy T2V's, the 20 conditioning channels start at zero.
``PRETRAIN_EXCLUDE`` concepts are held out, as for the other generators. EMA weights are what is saved.

Every ``--eval-every`` steps the EMA transformer animates ``--eval-videos`` held-out first frames through
the package's serving path (``GeneratorStage`` with the ``WanI2V`` adapter) and prints synthetic GenEval of
the videos and the PSNR of their first frame against the conditioning image; sample strips are written as
PNGs (rows: conditioning image, then the frames) next to the log.

    python scripts/train_i2v.py --out modules/assets/wan_i2v     # TIME on 2 CPU cores
"""
from __future__ import annotations

import argparse
import copy
import json
import os

import torch
from diffusers import WanTransformer3DModel
from torchmetrics.functional.image import peak_signal_noise_ratio

from posttrain.datamodules.synthetic import PRETRAIN_EXCLUDE, ShapesDataset
from posttrain.modules.models.cards import Expert, ModelCard
from posttrain.modules.models.generators import GeneratorStage, VideoSize
from posttrain.modules.world.geneval import SyntheticGenEval
from posttrain.modules.flow.losses import flow_matching_loss, noised, sample_sigmas
from posttrain.modules.io.media import write_media
from posttrain.modules.models.presets import PRESETS, TRAINED_ASSETS
from posttrain.modules.flow.samplers import FlowMatchSampler
from pretraining import loop_arguments, pretrain  # beside this script, which runs as a file


def init_from_t2v(transformer: WanTransformer3DModel, t2v_path: str) -> None:
    """Copy a text-to-video Wan's weights into the I2V transformer: every tensor of equal shape, and the
    patch embedding's noisy-latent input channels; the mask and image channels start at zero."""
    t2v = WanTransformer3DModel.from_pretrained(t2v_path).state_dict()
    state = transformer.state_dict()
    for key, value in t2v.items():
        if key in state and state[key].shape == value.shape:
            state[key] = value.clone()
        elif key == "patch_embedding.weight":
            state[key] = torch.zeros_like(state[key])
            state[key][:, : value.shape[1]] = value
    transformer.load_state_dict(state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vae", default=TRAINED_ASSETS["wan_vae"])
    parser.add_argument("--text-encoder", default=TRAINED_ASSETS.get("umt5"))
    parser.add_argument("--t2v", default=TRAINED_ASSETS.get("wan_t2v"), help="initialize from these T2V weights")
    parser.add_argument("--videos", type=int, default=4096)
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--size", type=int, default=32)
    loop_arguments(parser, steps=20000, minutes=40.0, ema=0.995, eval_every=500)
    parser.add_argument("--caption-dropout", type=float, default=0.1)
    parser.add_argument("--text-max-length", type=int, default=64)
    parser.add_argument("--eval-videos", type=int, default=32)
    parser.add_argument("--guidance", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--log-dir", default="runs/world_i2v")
    parser.add_argument("--out", default="modules/assets/wan_i2v")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    os.makedirs(args.log_dir, exist_ok=True)

    # the stage as a method builds it; its transformer receives the EMA weights before each evaluation
    card = ModelCard({"text_encoder": Expert(arch="umt5", pretrained=args.text_encoder),
                      "vae": Expert(arch="wan_vae", pretrained=args.vae),
                      "transformer": Expert(arch="wan_i2v", preset=PRESETS["wan_i2v"])},
                     text_max_length=args.text_max_length)
    card.build()
    stage = GeneratorStage(card)
    size = VideoSize(args.frames, args.size, args.size)

    # 1. the data, encoded once: clean latents, the pipeline's image conditioning, captions
    data = ShapesDataset(args.videos, args.frames, args.size, args.size, seed=1, exclude=PRETRAIN_EXCLUDE)
    latents, conditions, prompts = [], [], []
    with torch.no_grad():
        for i in range(0, args.videos, 64):
            items = [data[j] for j in range(i, min(i + 64, args.videos))]
            videos = torch.stack([it["video"] for it in items])
            latents.append(stage.encode(videos))
            conditions.append(stage.adapter.image(stage, videos[:, :, 0], size)["image_latents"])
            prompts += [it["prompt"] for it in items]
    latents, conditions = torch.cat(latents), torch.cat(conditions)
    print(f"{len(prompts)} videos, latents {tuple(latents.shape[1:])}, conditions {tuple(conditions.shape[1:])}",
          flush=True)

    transformer = WanTransformer3DModel(**PRESETS["wan_i2v"]).train()
    if args.t2v and os.path.isdir(args.t2v):
        init_from_t2v(transformer, args.t2v)
        print(f"initialized from {args.t2v}", flush=True)
    print(f"Wan I2V {sum(p.numel() for p in transformer.parameters()) / 1e6:.3f}M parameters", flush=True)
    ema = copy.deepcopy(transformer).eval().requires_grad_(False)
    sampler = FlowMatchSampler(num_steps=20, guidance_scale=args.guidance)

    held = ShapesDataset(args.eval_videos, args.frames, args.size, args.size, seed=2, exclude=PRETRAIN_EXCLUDE)
    held_videos = torch.stack([held[i]["video"] for i in range(len(held))])
    held_prompts = [held[i]["prompt"] for i in range(len(held))]

    def evaluate(step: int, minutes: float) -> dict:
        card.models["transformer"].load_state_dict(ema.state_dict())
        images = held_videos[:, :, 0]
        noise = torch.randn((len(held_prompts), *stage.latent_shape(size)), generator=torch.Generator().manual_seed(0))
        cond, uncond = stage.conditioning(held_prompts, sampler.guidance_scale, images=images, size=size)
        videos = stage.decode(stage.sample(sampler, noise, cond, uncond).latents)  # (B, 3, F, H, W)
        metric = SyntheticGenEval()
        metric.update(videos, held_prompts)
        psnr = peak_signal_noise_ratio((videos[:, :, 0] + 1) / 2, (images + 1) / 2, data_range=1.0)
        rows = [torch.cat([images[b], *videos[b].unbind(1)], dim=-1) for b in range(8)]
        write_media(os.path.join(args.log_dir, f"samples_{step:06d}.png"), torch.cat(rows, dim=-2)[:, None])
        scores = {"step": step, "minutes": minutes, "first_frame_psnr": round(float(psnr), 2),
                  **{k: round(float(v), 3) for k, v in metric.compute().items()}}
        print("geneval", json.dumps(scores), flush=True)
        return scores

    def loss_of(g: torch.Generator) -> torch.Tensor:
        idx = torch.randint(len(prompts), (args.batch_size,), generator=g)
        x0 = latents[idx]
        # 2. captions through the frozen UMT5 (cached), a share dropped for CFG; the image condition always stays
        drop = (torch.rand(args.batch_size, generator=g) < args.caption_dropout).tolist()
        text = stage.adapter.text(stage, ["" if d else prompts[i] for i, d in zip(idx.tolist(), drop)])
        cond = {**text, "image_latents": conditions[idx]}
        # 3. x_σ = (1-σ)·x0 + σ·ε at logit-normal σ; v_θ regressed onto ε - x0
        sigma = sample_sigmas(args.batch_size, "logit_normal", g)
        noise = torch.randn(x0.shape, generator=g)
        v = stage.adapter.velocity(transformer, noised(x0, noise, sigma), sampler.timestep_of(sigma), cond)
        return flow_matching_loss(v, x0, noise)[0].mean()

    step, minutes, history = pretrain(loss_of, {"transformer": transformer}, {"transformer": ema}, args, evaluate)
    ema.save_pretrained(args.out, safe_serialization=True)
    print(f"saved {args.out} after {step} steps, {minutes} min; last check "
          f"{json.dumps(history[-1])}")


if __name__ == "__main__":
    main()
