"""Pretrain the tiny Wan 2.2 TI2V of the world: one transformer for text-to-video and image-to-video.

Flow matching (rectified flow, logit-normal σ, 10% caption dropout for CFG) on the latents of the world's videos
through the world's Wan 2.2 VAE (``modules/assets/wan22_vae``, ``scripts/train_vae.py --arch wan22_vae``), with the
concepts of ``PRETRAIN_EXCLUDE`` held out, as ``scripts/train_world.py`` pretrains the world's Wan. The text encoder is
the world's UMT5 (``modules/assets/umt5``), frozen: the TI2V card reads prompts through it, and it already encodes the
world's words. As TI2V-5B was trained, each batch mixes the two tasks: a share ``--image-share`` of the rows is
image-to-video (their first latent frame the clip's own clean latents, its tokens at timestep 0, the loss on the
generated frames only; the adapter's ``velocity``), the rest text-to-video. The EMA weights are what is saved.

Every ``--eval-every`` steps the EMA transformer samples ``--eval-prompts`` seen-concept prompts through the
package's own serving path (``modules/eval/evaluation.py``: ``GeneratorStage`` with the ``WanTI2V`` adapter, the
configs' 20-step ODE) from text alone and from the first frames of held-out clips, and both are scored with
synthetic GenEval (shape, colour, background, motion).

    python scripts/train_ti2v.py --out runs/ti2v_smoke --minutes 1          # smoke run

The shipped ``modules/assets/wan22_ti2v`` is two runs, one thread each on the shared 2-core machine, on the latents of
the VAE's codec stage (``runs/ti2v/wan22_vae_c32``, ``scripts/train_vae.py``: its encoder and latent statistics are the
shipped VAE's, whose wider decoder came after, so the default ``--vae`` gives the same latents and cache):

    python scripts/train_ti2v.py --vae runs/ti2v/wan22_vae_c32 --from-world --minutes 32 --eval-every 3000 \
        --out runs/ti2v/gen_world                                                 # 15965 steps
    python scripts/train_ti2v.py --vae runs/ti2v/wan22_vae_c32 --init runs/ti2v/gen_world --lr 3e-4 --minutes 30 \
        --eval-every 3000 --out runs/ti2v/gen_world2                              # 16105 more steps

``--from-world`` starts 120 of the transformer's 123 tensors (its blocks, text and time embedders) from the world's
Wan T2V, the patch embedding and the output projection (48 channels here, 16 there) random. From random weights
(no ``--from-world``, the same command otherwise) the check at 12000 steps (25 min) read back text-to-video colour 0.70,
motion 0.27 and image-to-video colour 0.91, motion 0.48; from the world's Wan at 12000 steps (24 min) 0.84, 0.58 and
1.0, 0.94. ``--evaluate modules/assets`` (through the shipped VAE, 64 seen-concept prompts, no CFG) reads back:

    text-to-video:   shape 0.47, colour 0.84, background 1.0, motion 0.77, all four 0.39
    image-to-video:  shape 0.78, colour 0.97, background 1.0, motion 1.0,  all four 0.77

and with ``--guidance 4.5`` 0.45 / 0.88 / 1.0 / 0.98 (all four 0.42) and 0.72 / 1.0 / 1.0 / 1.0 (0.72). Chance is 1/3,
1/6, 1/6, 1/4. Shapes are soft (the 8x VAE's 4 x 4 latents hold a 32 px frame; its reconstructions read back shape
0.85); colour, background and motion follow the prompt, and image-to-video keeps the given frame and moves it.

Writes ``<out>/wan22_ti2v`` (``save_pretrained``, safetensors) at every check.
"""
from __future__ import annotations

import argparse
import copy
import json
import os

import torch
from transformers import ByT5Tokenizer

from posttrain.datamodules.synthetic import PRETRAIN_EXCLUDE, ShapesDataset
from posttrain.modules.eval.evaluation import evaluate_generator
from posttrain.modules.flow.conditioning import Conditioning
from posttrain.modules.flow.losses import noised, sample_sigmas
from posttrain.modules.flow.samplers import FlowMatchSampler
from posttrain.modules.models.generators import ADAPTERS, wan_text_states, wan_tokens
from posttrain.modules.models.presets import PRESETS, TRAINED_ASSETS, build_model
from pretraining import loop_arguments, pretrain  # beside this script, which runs as a file
from train_world import encoded_dataset

ARCH = "wan22_ti2v"


def geneval(transformer, encoder, tokenizer, vae, args) -> dict[str, dict[str, float]]:
    """Synthetic GenEval of ODE samples of ``--eval-prompts`` seen-concept prompts (seed 2, never trained on), from
    the prompt alone (``t2v``) and from the first frame of each prompt's own clip (``i2v``)."""
    seen = ShapesDataset(args.eval_prompts, args.frames, args.size, args.size, seed=2, exclude=PRETRAIN_EXCLUDE,
                         speed=args.speed)
    prompts = [seen[i]["prompt"] for i in range(len(seen))]
    first = torch.stack([seen[i]["video"][:, 0] for i in range(len(seen))])
    sampler = FlowMatchSampler(num_steps=20, guidance_scale=args.guidance)
    scores = {}
    for task, images in {"t2v": None, "i2v": first}.items():
        result = evaluate_generator(transformer, encoder, tokenizer, vae, prompts, images=images, frames=args.frames,
                                    height=args.size, width=args.size, sampler=sampler,
                                    text_max_length=args.text_max_length, arch=ARCH)
        scores[task] = {k: round(float(v), 3) for k, v in result.items()}
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vae", default=TRAINED_ASSETS["wan22_vae"])
    parser.add_argument("--videos", type=int, default=4096, help="pretraining videos (encoded once, cached)")
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--speed", type=float, default=None)
    parser.add_argument("--size", type=int, default=32)
    loop_arguments(parser, steps=100000, minutes=50.0, ema=0.998, eval_every=2000)
    parser.add_argument("--caption-dropout", type=float, default=0.1)
    parser.add_argument("--image-share", type=float, default=0.5, help="share of the rows trained as image-to-video")
    parser.add_argument("--text-max-length", type=int, default=64)
    parser.add_argument("--eval-prompts", type=int, default=64)
    parser.add_argument("--guidance", type=float, default=1.0, help="CFG scale of the evaluation samples")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (on a shared machine more spin)")
    parser.add_argument("--cache", default="runs/ti2v/latents.safetensors")
    parser.add_argument("--out", default="runs/ti2v")
    parser.add_argument("--init", metavar="FOLDER", help="start from FOLDER/wan22_ti2v instead of random weights")
    parser.add_argument("--from-world", action="store_true", help="start every weight of the same shape from the "
                        "world's Wan T2V (modules/assets/wan_t2v: its blocks, text and time embedders), the patch "
                        "embedding and the output projection (48 channels here, 16 there) random")
    parser.add_argument("--evaluate", metavar="FOLDER", help="train nothing: print the evaluation of "
                        "FOLDER/wan22_ti2v (e.g. modules/assets) and stop")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    vae = build_model("wan22_vae", pretrained=args.vae).eval().requires_grad_(False)
    encoder = build_model("umt5").eval().requires_grad_(False)  # the world's, frozen
    tokenizer = ByT5Tokenizer()
    if args.evaluate:
        transformer = build_model(ARCH, pretrained=os.path.join(args.evaluate, ARCH)).eval()
        print("geneval", json.dumps(geneval(transformer, encoder, tokenizer, vae, args)), flush=True)
        return
    latents, prompts = encoded_dataset(vae, args.videos, args.frames, args.size, args.cache, args.speed)
    print(f"{len(prompts)} pretraining videos, latents {tuple(latents.shape[1:])}", flush=True)
    if args.init:
        transformer = build_model(ARCH, pretrained=os.path.join(args.init, ARCH)).train()
    else:
        transformer = build_model(ARCH, preset=dict(PRESETS[ARCH])).train()  # random weights of the preset
        if args.from_world:
            world = build_model("wan_t2v").state_dict()
            own = transformer.state_dict()
            same = {k: v for k, v in world.items() if k in own and own[k].shape == v.shape}
            transformer.load_state_dict(same, strict=False)
            print(f"from the world's Wan T2V: {len(same)} of {len(own)} tensors; random: "
                  f"{sorted(set(own) - set(same))}", flush=True)
    print(f"Wan 2.2 TI2V {sum(p.numel() for p in transformer.parameters()) / 1e6:.3f}M parameters", flush=True)
    ema = copy.deepcopy(transformer).eval()
    adapter = ADAPTERS[ARCH]

    # the frozen encoder reads every caption once; the empty prompt (caption dropout) is the last row
    ids, mask = wan_tokens(tokenizer, prompts + [""], args.text_max_length)
    with torch.no_grad():
        states = torch.cat([wan_text_states(encoder, ids[i:i + 256], mask[i:i + 256])
                            for i in range(0, len(ids), 256)])

    def evaluate(step: int, minutes: float) -> dict:
        scores = {"step": step, "minutes": minutes, **geneval(ema, encoder, tokenizer, vae, args)}
        print("geneval", json.dumps(scores), flush=True)
        ema.save_pretrained(os.path.join(args.out, ARCH), safe_serialization=True)
        return scores

    n_image = round(args.image_share * args.batch_size)  # the first rows of every batch are image-to-video

    def loss_of(g: torch.Generator) -> torch.Tensor:
        idx = torch.randint(len(prompts), (args.batch_size,), generator=g)
        x0 = latents[idx]
        drop = torch.rand(args.batch_size, generator=g) < args.caption_dropout
        text = states[torch.where(drop, len(prompts), idx)]
        sigma = sample_sigmas(args.batch_size, "logit_normal", g)
        noise = torch.randn(x0.shape, generator=g)
        x, target = noised(x0, noise, sigma), noise - x0
        errors = []  # per row: the squared error of the frames the model generates
        if n_image:  # image-to-video: the first latent frame is the clip's own, clean; the loss on the rest
            cond = Conditioning(encoder_hidden_states=text[:n_image], first_frame_latents=x0[:n_image, :, :1])
            v = adapter.velocity(transformer, x[:n_image], sigma[:n_image] * 1000, cond)
            errors.append(((v.float() - target[:n_image]) ** 2)[:, :, 1:].flatten(1).mean(1))
        if n_image < args.batch_size:  # text-to-video
            cond = Conditioning(encoder_hidden_states=text[n_image:])
            v = adapter.velocity(transformer, x[n_image:], sigma[n_image:] * 1000, cond)
            errors.append(((v.float() - target[n_image:]) ** 2).flatten(1).mean(1))
        return torch.cat(errors).mean()

    step, minutes, _ = pretrain(loss_of, {ARCH: transformer}, {ARCH: ema}, args, evaluate)
    print(f"saved {args.out}/{ARCH} after {step} steps, {minutes} min")


if __name__ == "__main__":
    main()
