"""The loop every generator pretraining script of the world runs (``train_world.py``, ``train_i2v.py``,
``train_flux.py``, ``train_qwen_image.py``, ``train_ti2v.py``): AdamW with a 200-step linear warm-up, gradients
clipped to norm 1, an EMA of every trained model (what the scripts save), a check every ``--eval-every`` steps and at
the end; it stops at ``--steps`` or ``--minutes``, whichever comes first. Each script gives its loss and its check.
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch


def loop_arguments(parser: argparse.ArgumentParser, *, steps: int, minutes: float, ema: float, eval_every: int
                   ) -> None:
    """The arguments ``pretrain`` reads, with a script's defaults (batch size 32, lr 1e-3 in every script)."""
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--minutes", type=float, default=minutes, help="stop after this much wall time")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ema", type=float, default=ema)
    parser.add_argument("--eval-every", type=int, default=eval_every)


@torch.no_grad()
def ema_update(ema: torch.nn.Module, model: torch.nn.Module, decay: float) -> None:
    for e, p in zip(ema.parameters(), model.parameters()):
        e.lerp_(p, 1 - decay)


def pretrain(loss_of: Callable[[torch.Generator], torch.Tensor], models: dict[str, torch.nn.Module],
             emas: dict[str, torch.nn.Module], args, evaluate: Callable[[int, float], dict]
             ) -> tuple[int, float, list[dict]]:
    """Train ``models`` on ``loss_of(g)`` (one batch drawn with the run's generator ``g``, seeded 0) under ``args``'
    ``lr``, ``ema``, ``steps``, ``minutes`` and ``eval_every``; ``evaluate(step, minutes)`` checks (and may save) the
    ``emas``. Returns the last step, the minutes it took and every check's result."""
    params = [p for model in models.values() for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 200))
    g = torch.Generator().manual_seed(0)
    start, step, history = time.time(), 0, []

    def minutes() -> float:
        return round((time.time() - start) / 60, 1)

    while step < args.steps and time.time() - start < args.minutes * 60:
        step += 1
        loss = loss_of(g)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        for name, model in models.items():
            ema_update(emas[name], model, args.ema)
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.4f} ({time.time() - start:.0f}s)", flush=True)
        if step % args.eval_every == 0:
            history.append(evaluate(step, minutes()))
    if not history or history[-1]["step"] != step:
        history.append(evaluate(step, minutes()))
    return step, minutes(), history
