"""A before/after sheet to look at (matplotlib PNG): the prompts whose verdict training changed, each as its frames
before and after from the same noise — what ``experiments/rl_captions.py`` (captions) and
``experiments/request_sheet.py`` (requests) draw.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from posttrain.modules.world.geneval import judge
from posttrain.modules.world.world import FACTS


def sheet(path: str, prompts: list[str], before: torch.Tensor, after: torch.Tensor, rows: int = 12,
          facts: Optional[list] = None, served: Optional[tuple[list[str], list[str]]] = None,
          what: str = "evaluation captions") -> tuple[list[int], list[int]]:
    """A PNG to look at (matplotlib): the evaluation prompts whose all-four verdict training changed (fixed
    first, then broken; the counts in the title), each as its frames before and after (the same noise). The
    verdicts are against the prompts' own facts, or ``facts`` (a request's: every fact it asks); ``served``
    (before, after) adds above each frame strip the prompt the generator was served. Returns the indices fixed
    and broken."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from posttrain.modules.world.geneval import judge_facts

    verdicts = [judge(videos, prompts) if facts is None else judge_facts(videos, facts) for videos in (before, after)]
    shown = [torch.stack([v[f] for f in FACTS], 1).nan_to_num(1.0).eq(1).all(1) for v in verdicts]
    fixed = torch.nonzero(~shown[0] & shown[1]).flatten().tolist()
    broken = torch.nonzero(shown[0] & ~shown[1]).flatten().tolist()
    order = (fixed + broken)[:rows] or list(range(min(rows, len(prompts))))
    height = 1.25 if served else 1.1
    fig, axes = plt.subplots(len(order), 2, figsize=(9 if served else 8, height * len(order) + 0.6), squeeze=False)
    for col, (tag, videos) in enumerate((("before", before), ("after", after))):
        for row, i in enumerate(order):
            frames = ((videos[i].permute(1, 2, 3, 0) + 1) / 2).clamp(0, 1)  # (F, H, W, 3)
            wrong = [f for f in FACTS if verdicts[col][f][i] == 0]
            ax = axes[row, col]
            ax.imshow(torch.cat(list(frames), dim=1).numpy(), interpolation="nearest")  # frames side by side
            ax.set_xticks([]), ax.set_yticks([])
            if wrong:
                title = f"{tag}: wrong " + ", ".join(wrong)
            else:
                title = f"{tag}: all {'four' if facts is None else 'asked'} shown"
            if served:
                title += f"\nserved: {served[col][i][:60]}"
            ax.set_title(title, fontsize=6 if served else 7, color="green" if not wrong else "red")
            if col == 0:
                ax.set_ylabel(prompts[i].replace(" on a ", "\non a ").replace(", ", ",\n", 1), fontsize=6,
                              rotation=0, ha="right", va="center")
    fig.suptitle(f"{len(prompts)} {what}: all {'four' if facts is None else 'asked'} shown {int(shown[0].sum())} "
                 f"before, {int(shown[1].sum())} after; {len(fixed)} fixed, {len(broken)} broken", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fixed, broken
