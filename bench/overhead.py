"""Seconds per finetune iteration through `posttrain fit` vs a plain PyTorch loop, interleaved in one run.

Both sides use the same tiny Wan card (real classes), the same synthetic data, the config's AdamW and its
learning-rate schedule, gradient clipping, caption dropout, the EMA of configs/finetune.yaml and a prompt-embedding
cache; the plain loop is what a research script would write. `posttrain fit` runs with W&B offline, every callback the method brings
(iteration counter, weight versions) and the config's logging cadence; checkpoints, sample videos and
validation are off (they are periodic, not per-iteration work).

The two alternate in blocks inside one process (see ``timing.py``): a callback of the fit pauses it every
``--per-block`` iterations and runs a block of the plain loop, so every fit block is bracketed by two
plain blocks; a fit block is timed hook to hook and holds all Lightning does per iteration. Prints the
medians, the paired ratio's spread and a verdict (goal <= 1.03).

    python -m bench.overhead [--blocks 300] [--per-block 10] [--warmup 140] [--batch-size 4] [--progress-bar]

Many short blocks: on a shared machine the CPU time of one iteration wanders by ~10% over seconds even on one
repeated batch, so only neighbouring blocks compare, and the median's interval narrows with their number.
"""
from __future__ import annotations

import argparse
import copy
import os
import time

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import torch  # noqa: E402
from lightning.pytorch import Callback  # noqa: E402

from bench.timing import Blocks, compare  # noqa: E402
from posttrain.lit.tools.config import PosttrainCLI  # noqa: E402
from posttrain.modules.models import vae as vae_codec  # noqa: E402
from posttrain.modules.flow.losses import flow_matching_loss, noised, sample_sigmas# noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "finetune.yaml")
GOAL = 1.03


class PlainLoop:
    """The same training written as a bare loop over the same card and data; ``step()`` is one iteration."""

    def __init__(self, batch_size: int, config: str = CONFIG):
        cli = PosttrainCLI(args=["--config", config, f"--data.init_args.batch_size={batch_size}"], run=False)
        model, self.data = cli.model, cli.datamodule
        model.configure_model()
        self.card, self.method = model.card, model
        self.transformer, self.vae, self.encoder = self.card["transformer"], self.card["vae"], self.card["text_encoder"]
        self.transformer.train()
        self.ema = None
        if model.ema_decay is not None:
            self.ema = copy.deepcopy(self.transformer).requires_grad_(False)
        # the config's own optimizer and learning-rate schedule, built from the card as the fit builds them
        self.optimizer = self.card.optimizer_for("transformer", self.card.parameters_of("transformer"))
        schedule = self.card.specs["transformer"].scheduler
        self.scheduler = None if schedule is None else schedule(self.optimizer)
        self.generator = torch.Generator().manual_seed(0)
        self.cache: dict[str, torch.Tensor] = {}
        self.loader = self.data.train_dataloader()
        self.batches = iter(self.loader)

    @torch.no_grad()
    def encode_text(self, prompts: list[str]) -> torch.Tensor:
        """UMT5 hidden states, zero after each prompt's tokens (as WanPipeline encodes)."""
        tokens = self.card.tokenizers["text_encoder"](prompts, padding="max_length", truncation=True,
                                                      max_length=self.card.text_max_length, return_tensors="pt")
        hidden = self.encoder(tokens.input_ids, tokens.attention_mask).last_hidden_state
        return hidden * tokens.attention_mask.unsqueeze(-1).to(hidden.dtype)

    def step(self) -> None:
        batch = next(self.batches, None)
        if batch is None:  # next epoch, as the Trainer does
            self.batches = iter(self.loader)
            batch = next(self.batches)
        m = self.method
        with torch.no_grad():
            x0 = vae_codec.encode(self.vae, batch["video"])
            drop = torch.rand(len(batch["prompt"]), generator=self.generator) < m.caption_dropout
            prompts = ["" if d else p for p, d in zip(batch["prompt"], drop.tolist())]
            missing = list(dict.fromkeys(p for p in prompts if p not in self.cache))
            if missing:
                self.cache.update(zip(missing, self.encode_text(missing)))
            cond = torch.stack([self.cache[p] for p in prompts])
        sigma = sample_sigmas(x0.shape[0], m.sigma_sampling, self.generator, m.shift, m.logit_mean, m.logit_std)
        noise = torch.randn(x0.shape, generator=self.generator)
        v = self.transformer(hidden_states=noised(x0, noise, sigma), timestep=sigma * 1000,
                             encoder_hidden_states=cond, return_dict=False)[0]
        loss = flow_matching_loss(v, x0, noise)[0].mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.transformer.parameters(), 1.0)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            with torch.no_grad():
                for e, p in zip(self.ema.parameters(), self.transformer.parameters()):
                    e.lerp_(p, 1.0 - m.ema_decay)


class Interleave(Callback):
    """Pauses the fit every ``per_block`` iterations (after ``warmup``) to run a block of the plain loop.

    Fit blocks are timed from this hook to the same hook ``per_block`` iterations later, so each holds
    exactly ``per_block`` whole iterations of Lightning's loop; the plain blocks run between them.
    """

    def __init__(self, plain: PlainLoop, blocks: Blocks, n_blocks: int, per_block: int, warmup: int):
        self.plain, self.blocks, self.n_blocks, self.per_block, self.warmup = plain, blocks, n_blocks, per_block, warmup
        self.seen, self.opened = 0, None

    @property
    def iterations(self) -> int:
        """Fit iterations needed: warm-up, the blocks, and one more whose hook closes the last block."""
        return self.warmup + self.n_blocks * self.per_block + 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        i, self.seen = self.seen, self.seen + 1
        if i == 0:
            for _ in range(self.warmup):
                self.plain.step()
        j = i - self.warmup
        if j < 0 or j % self.per_block:
            return
        if self.opened is not None:
            wall, cpu = self.opened
            self.blocks.record(self.blocks.candidate, time.perf_counter() - wall, time.process_time() - cpu,
                               self.per_block)
            self.opened = None
        if j // self.per_block <= self.n_blocks:
            self.blocks.run(self.blocks.baseline, self.plain.step, self.per_block)
        if j // self.per_block < self.n_blocks:
            self.opened = (time.perf_counter(), time.process_time())


def fit_args(iterations: int, batch_size: int, workdir: str, progress_bar: bool) -> list[str]:
    return ["--config", CONFIG, f"--trainer.max_steps={iterations}", "--trainer.val_check_interval=100000",
            "--trainer.limit_val_batches=0", f"--trainer.enable_progress_bar={str(progress_bar).lower()}",
            f"--trainer.default_root_dir={workdir}", f"--data.init_args.batch_size={batch_size}",
            "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]"]


def run(blocks: int, per_block: int, warmup: int, batch_size: int, workdir: str, progress_bar: bool = False) -> Blocks:
    torch.manual_seed(0)
    plain = PlainLoop(batch_size)
    out = Blocks("plain PyTorch loop", "posttrain fit")
    timer = Interleave(plain, out, blocks, per_block, warmup)
    cli = PosttrainCLI(args=fit_args(timer.iterations, batch_size, workdir, progress_bar), run=False)
    cli.trainer.callbacks.append(timer)
    cli.trainer.fit(cli.model, cli.datamodule)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=300, help="fit blocks (plain blocks: one more)")
    parser.add_argument("--per-block", type=int, default=10, help="iterations per block (10: one logging iteration "
                        "of the config each)")
    parser.add_argument("--warmup", type=int, default=140, help="iterations of each side before the first block "
                        "(an epoch of the config's data at batch 4: every caption cached)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both sides)")
    parser.add_argument("--progress-bar", action="store_true", help="fit with Lightning's progress bar on")
    parser.add_argument("--workdir", default="runs/bench_overhead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    blocks = run(args.blocks, args.per_block, args.warmup, args.batch_size, args.workdir, args.progress_bar)
    print(f"finetune iteration, batch {args.batch_size}, {args.threads} thread(s), progress bar "
          f"{'on' if args.progress_bar else 'off'}: {args.blocks} fit blocks between {args.blocks + 1} plain blocks "
          f"of {args.per_block} iterations")
    print(compare(blocks, goal=GOAL, ratio_name="posttrain/plain").report())


if __name__ == "__main__":
    main()
