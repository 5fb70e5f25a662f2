"""``posttrain reward``: check a config's reward before training — its spread and its ranking, in a table and a sheet.

    posttrain reward --config configs/flow_grpo.yaml --out runs/reward_check
    posttrain reward --config configs/flow_grpo.yaml --videos my_clips/ --num_samples 64

Scores up to ``num_samples`` samples with the config's reward (``model.init_args.reward``, built as training
builds it: a folder that cannot serve stops here too):

- ``--videos <folder>``: a folder of captioned videos/images in ``VideoFolder``'s layouts (a ``.txt`` beside each
  file, or a ``metadata.jsonl``), read at the method's ``run`` size;
- else the config's data: the videos of a video datamodule, or, for prompt data (the RL methods), videos the
  config's generator samples for those prompts (its ``predict`` path, seeds 0, 1, …).

It prints per term (and the total) mean / std / min / max, and writes into ``out``: ``reward_table.txt`` (that
table), ``scores.jsonl`` (one line per sample: prompt, total, terms, source) and ``reward_sheet.png`` (matplotlib):
the ``top`` best and worst samples, a few frames each, with their scores and prompts — so a reward that ranks
blank frames or grids highest shows it before a long run does.
"""
from __future__ import annotations

import json
import os
import textwrap
from typing import Optional

import torch

from posttrain.lit.tools.config import instantiate_part, parse
from posttrain.modules.rewards.preference import frame_indices
from posttrain.modules.rewards.base import RewardOutput, reward_name, score


def reward(config: str, videos: Optional[str] = None, out: str = "reward_check", num_samples: int = 16,
           top: int = 4, batch_size: int = 8) -> str:
    """Score a config's data (or a folder of videos) with its reward: per-term statistics and the top and bottom
    samples as a PNG sheet, before any training.

    Args:
        config: a fit config (its ``model``'s reward, ``run`` size and ``data``).
        videos: a folder of captioned videos/images to score instead of the config's data.
        out: folder for ``reward_table.txt``, ``scores.jsonl`` and ``reward_sheet.png``.
        num_samples: how many samples to score (the first of the data, in order).
        top: how many best and worst samples the sheet shows.
        batch_size: samples per reward call (and per generation).

    Returns:
        the table (also written to ``out``).
    """
    problems = [f"{name}={value} must be >= 1" for name, value in
                (("num_samples", num_samples), ("top", top), ("batch_size", batch_size)) if value < 1]
    if problems:
        raise ValueError("reward: " + "; ".join(problems))
    cfg = parse(config, "reward")
    method = instantiate_part(cfg, "model", config, "reward")
    if getattr(method, "reward", None) is None:
        raise ValueError(f"reward: the method of {config!r} ({type(method).__name__}) has no reward to check; use a "
                         f"config of an RL method (flow_grpo, diffusion_nft, joint_rl, workflow_rl)")
    media, prompts, source = _samples(cfg, config, method, videos, num_samples, batch_size)
    outs = [score(method.reward, media[i:i + batch_size], prompts[i:i + batch_size])
            for i in range(0, len(prompts), batch_size)]
    result = RewardOutput(torch.cat([o.total for o in outs]),
                          {k: torch.cat([o.terms[k] for o in outs]) for k in outs[0].terms})
    os.makedirs(out, exist_ok=True)
    text = table(result, f"{reward_name(method.reward)} on {len(prompts)} samples ({source})")
    with open(os.path.join(out, "reward_table.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "scores.jsonl"), "w") as f:
        for i, prompt in enumerate(prompts):
            f.write(json.dumps({"index": i, "prompt": prompt, "total": result.total[i].item(),
                                "terms": {k: v[i].item() for k, v in result.terms.items()}}) + "\n")
    sheet(media, prompts, result.total, top, os.path.join(out, "reward_sheet.png"))
    return text + f"\nwrote {os.path.join(out, 'reward_sheet.png')}, reward_table.txt, scores.jsonl"


def _samples(cfg, config: str, method, videos: Optional[str], limit: int, batch_size: int):
    """(media (N, 3, F, H, W) on the CPU, N prompts, where they came from)."""
    size = method.video
    if videos is not None:
        from posttrain.datamodules.folder import list_items, read_frames, to_video

        items = list_items(videos)[:limit]
        clips = [to_video(read_frames(path, size.frames, repeat_images=True), size.height, size.width)
                 for path, _ in items]
        return torch.stack(clips), [caption for _, caption in items], f"folder {videos}"
    data = instantiate_part(cfg, "data", config, "reward")
    dataset = data.train_dataset()
    items = [dataset[i] for i in range(min(limit, len(dataset)))]
    prompts = [item["prompt"] for item in items]
    if "video" in items[0]:
        return torch.stack([item["video"] for item in items]).float(), prompts, f"the videos of {type(data).__name__}"
    method.configure_model()  # prompt data: the config's generator makes the videos, as predict does
    method.card.models.eval()
    clips = [method.generate(prompts[i:i + batch_size], seed=i // batch_size).cpu()
             for i in range(0, len(prompts), batch_size)]
    return torch.cat(clips), prompts, f"the config's generator on the prompts of {type(data).__name__}"


def table(out: RewardOutput, title: str) -> str:
    """Mean / std / min / max of the total and of each term."""
    rows = [("total", out.total)] + sorted(out.terms.items())
    width = max(len(name) for name, _ in rows)
    lines = [title, f"{'term':<{width}} {'mean':>10} {'std':>10} {'min':>10} {'max':>10}"]
    for name, values in rows:
        v = values.double()
        lines.append(f"{name:<{width}} {v.mean().item():>10.4f} {v.std(unbiased=False).item():>10.4f} "
                     f"{v.min().item():>10.4f} {v.max().item():>10.4f}")
    return "\n".join(lines)


def sheet(media: torch.Tensor, prompts: list[str], total: torch.Tensor, top: int, path: str, frames: int = 3) -> None:
    """A PNG of the ``top`` best (first row) and worst (second row) samples: ``frames`` evenly spaced frames side by
    side, the score and the prompt above."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    order = torch.argsort(total, descending=True, stable=True).tolist()
    k = min(top, len(order))
    rows = [("best", order[:k]), ("worst", order[::-1][:k])]
    fig, axes = plt.subplots(2, k, figsize=(3.2 * k, 4.2), squeeze=False)
    for r, (label, picks) in enumerate(rows):
        for c in range(k):
            ax = axes[r][c]
            ax.axis("off")
            i = picks[c]
            idx = frame_indices(media.shape[2], frames)
            strip = torch.cat(list(media[i][:, idx].unbind(1)), dim=-1)  # (3, H, frames·W)
            ax.imshow(((strip.clamp(-1, 1) + 1) / 2).permute(1, 2, 0).float().numpy())
            caption = textwrap.shorten(prompts[i], 60)
            ax.set_title(f"{label} #{c + 1}: {total[i].item():.4f}\n" + "\n".join(textwrap.wrap(caption, 30)),
                         fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
