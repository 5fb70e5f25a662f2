"""Seconds per finetune iteration through `posttrain fit` vs a plain PyTorch loop, same run.

Both sides use the same tiny Wan card (real classes), the same batches of the synthetic data, AdamW,
gradient clipping, and a prompt-embedding cache; the plain loop is what a research script would
write. Prints both timings and the ratio (goal <= 1.10).

    python bench/overhead.py [--iterations 200] [--batch-size 4]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from lightning.pytorch import Callback  # noqa: E402

from posttrain.lit.cli import PosttrainCLI  # noqa: E402
from posttrain.modules import vae as vae_codec  # noqa: E402
from posttrain.modules.losses import flow_matching_loss, noised, sample_sigmas  # noqa: E402
from posttrain.modules.samplers import wan_velocity  # noqa: E402
from posttrain.modules.text import encode_prompts  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "finetune.yaml")


class Timer(Callback):
    def __init__(self, warmup: int):
        self.warmup, self.start, self.end, self.count = warmup, None, None, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.count == self.warmup:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.count += 1
        self.end = time.perf_counter()


def posttrain_fit(iterations: int, warmup: int, batch_size: int, workdir: str) -> float:
    cli = PosttrainCLI(args=[
        "--config", CONFIG, f"--trainer.max_steps={iterations + warmup}", "--trainer.val_check_interval=100000",
        "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={workdir}", f"--data.init_args.batch_size={batch_size}",
        "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]",
    ], run=False)
    timer = Timer(warmup)
    cli.trainer.callbacks.append(timer)
    cli.trainer.fit(cli.model, cli.datamodule)
    return (timer.end - timer.start) / (timer.count - warmup)


def plain_loop(iterations: int, warmup: int, batch_size: int) -> float:
    """The same training written as a bare loop over the same card and data."""
    cli = PosttrainCLI(args=["--config", CONFIG, f"--data.init_args.batch_size={batch_size}"], run=False)
    model, dm = cli.model, cli.datamodule
    model.configure_model()
    card = model.card
    transformer, vae, encoder = card["transformer"], card["vae"], card["text_encoder"]
    transformer.train()
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=1e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    cache: dict[str, torch.Tensor] = {}
    loader = dm.train_dataloader()
    batches = iter(loader)
    start = None
    for i in range(iterations + warmup):
        if i == warmup:
            start = time.perf_counter()
        batch = next(batches, None)
        if batch is None:  # next epoch, as the Trainer does
            batches = iter(loader)
            batch = next(batches)
        with torch.no_grad():
            x0 = vae_codec.encode(vae, batch["video"])
            missing = [p for p in batch["prompt"] if p not in cache]
            if missing:
                cache.update(zip(missing, encode_prompts(card.tokenizers["text_encoder"], encoder, missing, 64)))
            cond = torch.stack([cache[p] for p in batch["prompt"]])
        sigma = sample_sigmas(x0.shape[0], "logit_normal", generator)
        noise = torch.randn(x0.shape, generator=generator)
        v = wan_velocity(transformer)(noised(x0, noise, sigma), sigma, cond)
        loss = flow_matching_loss(v, x0, noise)[0].mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / iterations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--workdir", default="runs/bench_overhead")
    args = parser.parse_args()
    torch.manual_seed(0)
    plain = plain_loop(args.iterations, args.warmup, args.batch_size)
    fit = posttrain_fit(args.iterations, args.warmup, args.batch_size, args.workdir)
    plain_again = plain_loop(args.iterations, args.warmup, args.batch_size)  # bracket: drift shows up
    baseline = (plain + plain_again) / 2
    print(f"plain PyTorch loop : {baseline * 1000:.1f} ms/iteration ({plain * 1000:.1f}, {plain_again * 1000:.1f})")
    print(f"posttrain fit      : {fit * 1000:.1f} ms/iteration")
    print(f"ratio posttrain/plain = {fit / baseline:.3f} (goal <= 1.10)")


if __name__ == "__main__":
    main()
