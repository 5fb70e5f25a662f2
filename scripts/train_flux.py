"""Pretrain the FLUX text-to-image stage of the world: CLIP, T5 and the FLUX transformer together; save all three.

Flow matching (rectified flow, logit-normal σ, 10% caption dropout for CFG) on the FLUX VAE's latents
(``scripts/train_flux_vae.py``) of the world's first frames, captioned with the video's full caption: in a
workflow one prompt drives the image stage and then the image-to-video stage, which reads the motion.
The concepts of ``PRETRAIN_EXCLUDE`` are held out, as for the world's text-to-video generator, so that
finetuning and RL have something to teach. Both text encoders train jointly with the transformer, by the
same loss (a frozen random encoder gives the generator almost nothing to follow; DESIGN.md, "Facts
measured"). EMA weights are what is saved.

Every ``--eval-every`` steps the EMA models sample ``--eval-prompts`` seen-concept prompts through the
package's own serving path (``GeneratorStage`` with the ``Flux`` adapter, FLUX.1's dynamic-shift scheduler)
and are scored with synthetic GenEval on what an image shows (shape, colour, background); sample grids are
written as PNGs next to the log.

    python scripts/train_flux.py --out runs/flux_a --minutes 40
    python scripts/train_flux.py --init runs/flux_a --out modules/assets --minutes 40   # TIME on 2 CPU cores

The shipped ``flux``, ``clip`` and ``t5`` are a 40-minute run (2826 steps) continued with ``--init modules/assets
--minutes 35 --threads 1`` (15142 more steps): its last check reads back shape 0.52, colour 0.98, background 1.0.

Writes ``<out>/flux``, ``<out>/clip``, ``<out>/t5`` (``save_pretrained``, safetensors).
"""
from __future__ import annotations

import argparse
import copy
import json
import os

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from posttrain.datamodules.synthetic import PRETRAIN_EXCLUDE, ShapesDataset
from posttrain.modules.models import vae as vae_codec
from posttrain.modules.models.cards import Expert, ModelCard
from posttrain.modules.models.generators import Flux, GeneratorStage, VideoSize, clip_pooled_embeds, t5_embeds
from posttrain.modules.flow.losses import flow_matching_loss, noised, sample_sigmas
from posttrain.modules.io.media import write_media
from posttrain.modules.models.presets import PRESETS, build_tokenizer
from posttrain.modules.flow.samplers import FlowMatchSampler
from pretraining import loop_arguments, pretrain  # beside this script, which runs as a file
from train_flux_vae import image_geneval  # GenEval of what a frame shows

FLUX_SCHEDULER = dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                      max_image_seq_len=4096)


@torch.no_grad()
def encoded_images(vae: AutoencoderKL, num: int, size: int, seed: int) -> tuple[torch.Tensor, list[str]]:
    """(N, 16, 1, h, w) normalized latents of the first frames of ``num`` world videos and their captions."""
    data = ShapesDataset(num, 1, size, size, seed=seed, exclude=PRETRAIN_EXCLUDE)
    latents, prompts = [], []
    for i in range(0, num, 64):
        items = [data[j] for j in range(i, min(i + 64, num))]
        latents.append(vae_codec.encode(vae, torch.stack([it["video"] for it in items])))
        prompts += [it["prompt"] for it in items]
    return torch.cat(latents), prompts



def serving_card(vae_path: str, text_max_length: int) -> ModelCard:
    """A card of the stage as a method builds it (the transformer and encoders get the EMA weights)."""
    card = ModelCard({"text_encoder": Expert(arch="clip", preset=PRESETS["clip"]),
                      "text_encoder_2": Expert(arch="t5", preset=PRESETS["t5"]),
                      "vae": Expert(arch="vae_kl", pretrained=vae_path),
                      "transformer": Expert(arch="flux", preset=PRESETS["flux"])}, text_max_length=text_max_length)
    card.build()
    return card


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vae", default="modules/assets/vae_kl")
    parser.add_argument("--images", type=int, default=4096, help="pretraining images (encoded once)")
    parser.add_argument("--size", type=int, default=32)
    loop_arguments(parser, steps=20000, minutes=40.0, ema=0.995, eval_every=500)
    parser.add_argument("--caption-dropout", type=float, default=0.1)
    parser.add_argument("--text-max-length", type=int, default=64)
    parser.add_argument("--eval-prompts", type=int, default=64)
    parser.add_argument("--guidance", type=float, default=1.0, help="CFG scale of the evaluation samples")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--log-dir", default="runs/world_flux")
    parser.add_argument("--init", default=None, help="continue from a folder this script wrote (its flux, clip, t5)")
    parser.add_argument("--out", default="modules/assets")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    os.makedirs(args.log_dir, exist_ok=True)

    vae = AutoencoderKL.from_pretrained(args.vae).eval().requires_grad_(False)
    latents, prompts = encoded_images(vae, args.images, args.size, seed=1)
    print(f"{len(prompts)} pretraining images, latents {tuple(latents.shape[1:])}", flush=True)

    tokenizer_clip = build_tokenizer(model_max_length=PRESETS["clip"]["max_position_embeddings"])
    tokenizer_t5 = build_tokenizer()
    clip = CLIPTextModel(CLIPTextConfig(**PRESETS["clip"])).train()
    t5 = T5EncoderModel(T5Config(**PRESETS["t5"])).train()
    transformer = FluxTransformer2DModel(**PRESETS["flux"]).train()
    models = {"text_encoder": clip, "text_encoder_2": t5, "transformer": transformer}
    if args.init:  # a later session of the same training (the EMA weights it saved; fresh optimizer state)
        for name, arch in (("transformer", "flux"), ("text_encoder", "clip"), ("text_encoder_2", "t5")):
            models[name].load_state_dict(type(models[name]).from_pretrained(os.path.join(args.init, arch)).state_dict())
        print(f"continuing from {args.init}", flush=True)
    print(" ".join(f"{k} {sum(p.numel() for p in m.parameters()) / 1e6:.3f}M" for k, m in models.items()), flush=True)
    emas = {k: copy.deepcopy(m).eval().requires_grad_(False) for k, m in models.items()}
    flux = Flux()

    card = serving_card(args.vae, args.text_max_length)
    stage = GeneratorStage(card)
    sampler = FlowMatchSampler(num_steps=20, scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER),
                               guidance_scale=args.guidance)
    seen = ShapesDataset(args.eval_prompts, 1, 8, 8, seed=2, exclude=PRETRAIN_EXCLUDE)
    eval_prompts = [seen[i]["prompt"] for i in range(len(seen))]

    def evaluate(step: int, minutes: float) -> dict:
        for name, ema in emas.items():  # serve the EMA weights; a new version = a fresh text cache
            card.models[name].load_state_dict(ema.state_dict())
            card.versions[name] += 1
        size = VideoSize(1, args.size, args.size)
        noise = torch.randn((len(eval_prompts), *stage.latent_shape(size)), generator=torch.Generator().manual_seed(0))
        cond, uncond = stage.conditioning(eval_prompts, sampler.guidance_scale, size=size)
        images = stage.decode(stage.sample(sampler, noise, cond, uncond).latents)  # (B, 3, 1, H, W)
        grid = torch.cat([torch.cat(list(images[r * 8:(r + 1) * 8, :, 0]), dim=-1) for r in range(2)], dim=-2)
        write_media(os.path.join(args.log_dir, f"samples_{step:06d}.png"), grid[:, None])
        scores = {"step": step, "minutes": minutes, **image_geneval(images[:, :, 0], eval_prompts)}
        print("geneval", json.dumps(scores), flush=True)
        return scores

    def loss_of(g: torch.Generator) -> torch.Tensor:
        idx = torch.randint(len(prompts), (args.batch_size,), generator=g)
        x0 = latents[idx]
        # 1. captions, a share dropped to the empty prompt (the unconditional branch of CFG)
        drop = (torch.rand(args.batch_size, generator=g) < args.caption_dropout).tolist()
        batch_prompts = ["" if d else prompts[i] for i, d in zip(idx.tolist(), drop)]
        cond = {"pooled_projections": clip_pooled_embeds(tokenizer_clip, clip, batch_prompts),
                "encoder_hidden_states": t5_embeds(tokenizer_t5, t5, batch_prompts, args.text_max_length)}
        # 2. x_σ = (1-σ)·x0 + σ·ε at logit-normal σ; v_θ regressed onto ε - x0 through all three models
        sigma = sample_sigmas(args.batch_size, "logit_normal", g)
        noise = torch.randn(x0.shape, generator=g)
        v = flux.velocity(transformer, noised(x0, noise, sigma), sampler.timestep_of(sigma), cond)
        return flow_matching_loss(v, x0, noise)[0].mean()

    step, minutes, history = pretrain(loss_of, models, emas, args, evaluate)

    for name, arch in (("transformer", "flux"), ("text_encoder", "clip"), ("text_encoder_2", "t5")):
        emas[name].save_pretrained(os.path.join(args.out, arch), safe_serialization=True)
    print(f"saved {args.out}/flux, clip, t5 after {step} steps, {minutes} min; "
          f"last check {json.dumps(history[-1])}")


if __name__ == "__main__":
    main()
