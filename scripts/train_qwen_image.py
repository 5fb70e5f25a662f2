"""Pretrain the tiny Qwen-Image of the world: the Qwen-Image transformer and its Qwen2.5-VL text encoder together.

Flow matching (rectified flow, logit-normal σ, 10% caption dropout for CFG) on the latents of the world's first
frames, captioned with the video's full caption, as ``scripts/train_flux.py`` pretrains FLUX; the concepts of
``PRETRAIN_EXCLUDE`` are held out, so finetuning and RL have something to teach. The VAE is the world's Wan VAE
(``modules/assets/wan_vae``), which ``AutoencoderKLQwenImage`` loads key for key (checked at start: no missing or
unexpected key), frozen. The text encoder reads the prompt through ``QwenImagePipeline``'s chat template with the
template tokenizer (``modules/assets/qwen_image_tokenizer``) and trains jointly with the transformer, by the same
loss (a frozen random encoder gives the generator almost nothing to follow). EMA weights are what is saved.

Every ``--eval-every`` steps the EMA models sample ``--eval-prompts`` seen-concept prompts through the package's own
serving path (``GeneratorStage`` with the ``QwenImage`` adapter, Qwen-Image's scheduler, the pipeline's true CFG
at ``--guidance``) and are scored with synthetic GenEval on what an image shows (shape, colour, background); sample
grids are written as PNGs next to the log. At the end the saved EMA is read back the same way on prompts and noise
of seeds it never saw, without CFG and with ``--final-guidance``.

    python scripts/train_qwen_image.py --out runs/qwen_image_a --minutes 1        # smoke run
    python scripts/train_qwen_image.py --out runs/qwen_image_a --minutes 65 --eval-every 2000 --threads 1

The shipped ``qwen_image`` and ``qwen2_5_vl`` are that 65-minute run (39651 steps, 1 CPU thread on a shared 2-core
machine), copied into modules/assets, the text encoder re-saved under the model's own tensor names (``save``
below: that run still wrote transformers' older names). Its last check (seed 2,
no CFG) reads back shape 0.34, colour 0.98, background 1.0; the final read-back on seeds 21-23 (64 prompts each) gives
shape 0.35, colour 0.96, background 1.0 without CFG and shape 0.34, colour 1.0, background 1.0 at true CFG 4. The
random tiny presets read back, the same way, shape 0.36, colour 0.05, background 0.25: colour and background are
learned, shape is not (chance is 1/3; the samples are blobs of the right colour on the right background).

Writes ``<out>/qwen_image`` and ``<out>/qwen2_5_vl`` (``save_pretrained``, safetensors).
"""
from __future__ import annotations

import argparse
import copy
import json
import os

import torch
from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler
from transformers import PreTrainedModel

from posttrain.datamodules.synthetic import PRETRAIN_EXCLUDE, ShapesDataset
from posttrain.modules.flow.losses import flow_matching_loss, noised, sample_sigmas
from posttrain.modules.flow.samplers import FlowMatchSampler
from posttrain.modules.io.media import write_media
from posttrain.modules.models.cards import Expert, ModelCard
from posttrain.modules.models.generators import GeneratorStage, VideoSize
from posttrain.modules.models.generators.qwen_image import (TOKENIZER_ASSET, QwenImage, prompt_mask,
                                                            qwen_prompt_embeds)
from posttrain.modules.models.presets import PRESETS, TRAINED_ASSETS, build_model, build_tokenizer
from pretraining import loop_arguments, pretrain  # beside this script, which runs as a file
from train_flux import encoded_images
from train_flux_vae import image_geneval

# Qwen-Image's scheduler_config.json (as configs/finetune_qwen_image.yaml gives it)
QWEN_SCHEDULER = dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
                      max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
SAVED = (("transformer", "qwen_image"), ("text_encoder", "qwen2_5_vl"))  # card name, arch (= folder)


def world_vae() -> AutoencoderKLQwenImage:
    """The ``qwen_image_vae`` preset's weights (the world's Wan VAE), loaded key for key or not at all."""
    vae, info = AutoencoderKLQwenImage.from_pretrained(TRAINED_ASSETS["qwen_image_vae"], output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise ValueError(f"{TRAINED_ASSETS['qwen_image_vae']} does not load into AutoencoderKLQwenImage key for key: "
                         f"{bad}; point the qwen_image_vae preset's asset at a Wan 2.1 VAE folder")
    return vae.eval().requires_grad_(False)


def save(model: torch.nn.Module, folder: str) -> None:
    """``save_pretrained`` (safetensors); a transformers model under its own tensor names (transformers 5 would write
    Qwen2.5-VL's older checkpoint names, which only its ``from_pretrained`` maps back: the fp8 build streams the
    tensors of a folder by the model's names, ``presets._streamed``)."""
    extra = {"save_original_format": False} if isinstance(model, PreTrainedModel) else {}
    model.save_pretrained(folder, safe_serialization=True, **extra)


def serving_card(text_max_length: int) -> ModelCard:
    """A card of the family as a method builds it (the transformer and text encoder get the EMA weights)."""
    card = ModelCard({"text_encoder": Expert(arch="qwen2_5_vl", tokenizer=TOKENIZER_ASSET,
                                             preset=PRESETS["qwen2_5_vl"]),
                      "vae": Expert(arch="qwen_image_vae"),
                      "transformer": Expert(arch="qwen_image", preset=PRESETS["qwen_image"])},
                     text_max_length=text_max_length)
    card.build()
    return card


@torch.no_grad()
def read_back(card: ModelCard, emas: dict[str, torch.nn.Module], prompts: list[str], size: int, guidance: float,
              seed: int, png: str | None = None) -> dict[str, float]:
    """GenEval of what the EMA models draw for ``prompts`` (noise of ``seed``) through the serving path; the first
    16 images as a 2 x 8 grid in ``png``."""
    for name, ema in emas.items():  # serve the EMA weights; a new version = a fresh text cache
        card.models[name].load_state_dict(ema.state_dict())
        card.versions[name] += 1
    stage = GeneratorStage(card)
    sampler = FlowMatchSampler(num_steps=20, scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER),
                               guidance_scale=guidance)
    video = VideoSize(1, size, size)
    noise = torch.randn((len(prompts), *stage.latent_shape(video)), generator=torch.Generator().manual_seed(seed))
    cond, uncond = stage.conditioning(prompts, sampler.guidance_scale, size=video)
    images = stage.decode(stage.sample(sampler, noise, cond, uncond).latents)  # (B, 3, 1, H, W)
    if png:
        grid = torch.cat([torch.cat(list(images[r * 8:(r + 1) * 8, :, 0]), dim=-1) for r in range(2)], dim=-2)
        write_media(png, grid[:, None])
    return image_geneval(images[:, :, 0], prompts)


def seen_prompts(n: int, seed: int) -> list[str]:
    data = ShapesDataset(n, 1, 8, 8, seed=seed, exclude=PRETRAIN_EXCLUDE)
    return [data[i]["prompt"] for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=4096, help="pretraining images (encoded once)")
    parser.add_argument("--size", type=int, default=32)
    loop_arguments(parser, steps=100000, minutes=65.0, ema=0.995, eval_every=500)
    parser.add_argument("--caption-dropout", type=float, default=0.1)
    parser.add_argument("--text-max-length", type=int, default=64)
    parser.add_argument("--eval-prompts", type=int, default=64)
    parser.add_argument("--guidance", type=float, default=1.0, help="true CFG scale of the periodic samples")
    parser.add_argument("--final-guidance", type=float, default=4.0, help="true CFG scale of the final read-back")
    parser.add_argument("--final-seeds", type=int, nargs="+", default=[21, 22, 23],
                        help="prompt and noise seeds of the final read-back (never used in training or the checks)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--log-dir", default="runs/world_qwen_image")
    parser.add_argument("--init", default=None, help="continue from a folder this script wrote (its qwen_image, "
                                                     "qwen2_5_vl)")
    parser.add_argument("--out", default="modules/assets")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    os.makedirs(args.log_dir, exist_ok=True)

    latents, prompts = encoded_images(world_vae(), args.images, args.size, seed=1)
    print(f"{len(prompts)} pretraining images, latents {tuple(latents.shape[1:])}", flush=True)

    tokenizer = build_tokenizer(TOKENIZER_ASSET)
    models = {name: build_model(arch, preset=PRESETS[arch]).train() for name, arch in SAVED}  # random tiny presets
    if args.init:  # a later session of the same training (the EMA weights it saved; fresh optimizer state)
        for name, arch in SAVED:
            models[name].load_state_dict(build_model(arch, pretrained=os.path.join(args.init, arch)).state_dict())
        print(f"continuing from {args.init}", flush=True)
    transformer, text_encoder = models["transformer"], models["text_encoder"]
    print(" ".join(f"{k} {sum(p.numel() for p in m.parameters()) / 1e6:.3f}M" for k, m in models.items()), flush=True)
    emas = {k: copy.deepcopy(m).eval().requires_grad_(False) for k, m in models.items()}
    adapter, timesteps = QwenImage(), FlowMatchSampler()  # the family's call; σ -> the timestep it reads

    card = serving_card(args.text_max_length)
    eval_prompts = seen_prompts(args.eval_prompts, seed=2)

    def evaluate(step: int, minutes: float) -> dict:
        png = os.path.join(args.log_dir, f"samples_{step:06d}.png")
        scores = {"step": step, "minutes": minutes,
                  **read_back(card, emas, eval_prompts, args.size, args.guidance, seed=0, png=png)}
        print("geneval", json.dumps(scores), flush=True)
        return scores

    def loss_of(g: torch.Generator) -> torch.Tensor:
        idx = torch.randint(len(prompts), (args.batch_size,), generator=g)
        x0 = latents[idx]
        # 1. captions, a share dropped to the empty prompt (the negative prompt of true CFG)
        drop = (torch.rand(args.batch_size, generator=g) < args.caption_dropout).tolist()
        batch_prompts = ["" if d else prompts[i] for i, d in zip(idx.tolist(), drop)]
        states = qwen_prompt_embeds(tokenizer, text_encoder, batch_prompts, args.text_max_length)
        cond = {"encoder_hidden_states": states,
                "encoder_hidden_states_mask": prompt_mask(tokenizer, batch_prompts, states.shape[1])}
        # 2. x_σ = (1-σ)·x0 + σ·ε at logit-normal σ; v_θ regressed onto ε - x0 through both models
        sigma = sample_sigmas(args.batch_size, "logit_normal", g)
        noise = torch.randn(x0.shape, generator=g)
        v = adapter.velocity(transformer, noised(x0, noise, sigma), timesteps.timestep_of(sigma), cond)
        return flow_matching_loss(v, x0, noise)[0].mean()

    step, minutes, history = pretrain(loss_of, models, emas, args, evaluate)

    for name, arch in SAVED:
        save(emas[name], os.path.join(args.out, arch))
    print(f"saved {args.out}/qwen_image, qwen2_5_vl after {step} steps, {minutes} min; "
          f"last check {json.dumps(history[-1])}", flush=True)

    # 3. the saved EMA on prompts and noise of seeds never used: no CFG (how RL rolls out) and true CFG
    for guidance in (1.0, args.final_guidance):
        per_seed = [read_back(card, emas, seen_prompts(args.eval_prompts, seed), args.size, guidance, seed=seed,
                              png=os.path.join(args.log_dir, f"final_cfg{guidance:g}_seed{seed}.png"))
                    for seed in args.final_seeds]
        mean = {k: round(sum(s[k] for s in per_seed) / len(per_seed), 3) for k in per_seed[0]}
        print(f"final read-back, CFG {guidance:g}, seeds {args.final_seeds}: {json.dumps(mean)} "
              f"(per seed {json.dumps(per_seed)})", flush=True)


if __name__ == "__main__":
    main()
