"""A reward served by ``posttrain serve-reward`` against the same reward in the training process.

1. Throughput: batches of decoded-size videos scored by the reward in this process (baseline) and by
   ``RemoteReward`` through a server in its own process (``python -m posttrain serve-reward``, loopback) in
   alternating blocks (``timing.py``); prints videos per second of each side and the ratio remote/local of the time
   per batch with its interval. The remote side pays the request's encoding, the loopback transfer, the decoding and
   the answer; the reward's own work is the same.
   Both sides run torch on one thread (the server with ``--threads 1``).
2. The share of a flow_grpo iteration spent waiting on the server: a few iterations of ``configs/flow_grpo.yaml``'s
   method with its reward replaced by ``RemoteReward`` to the same server; per iteration, the seconds the client
   waited for answers over the iteration's seconds (median over iterations).

    python -m bench.reward_server                                       # SyntheticGenEvalReward, 16 videos of 5x32x32
    python -m bench.reward_server --reward ColourAlignment --batch 64 --encoding uint8
    python -m bench.reward_server --reward PickScore --reward-path /models/pickscore --batch 8

On a shared machine the two processes compete for the same cores: read the ratio with the load beside it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
from lightning.pytorch import Callback, Trainer

from bench.timing import compare, interleave
from posttrain.datamodules.prompts import Prompts
from posttrain.lit.tools.config import instantiate_part, parse
from posttrain.modules.rewards.remote import RemoteReward
from posttrain.modules.rewards.base import score

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["a red circle moving left on a blue background", "a yellow square moving down on a magenta background"]


def start_server(reward: str, reward_path: str | None) -> tuple[subprocess.Popen, str]:
    args = [sys.executable, "-m", "posttrain", "serve-reward", "--reward", reward, "--port", "0", "--threads", "1"]
    if reward_path:
        args += ["--reward.path", reward_path]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    seen = ""  # a dependency may log a line before the URL; the server prints it once it listens
    for line in process.stdout:
        if " at http://" in line:
            return process, line.split(" at ")[1].split()[0]
        seen += line
    process.kill()
    raise SystemExit(f"serve-reward did not start: {seen}")


def local_reward(name: str, path: str | None):
    import posttrain.modules.rewards.preference as preference
    import posttrain.modules.rewards as rewards

    cls = getattr(rewards, name, None) or getattr(preference, name)
    return cls(path) if path else cls()


class IterationTimes(Callback):
    """Seconds of every iteration and the client's waiting on the server within it."""

    def __init__(self, remote: RemoteReward):
        self.remote, self.rows = remote, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.start, self.waited = time.perf_counter(), self.remote.waited

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append((time.perf_counter() - self.start, self.remote.waited - self.waited))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reward", default="SyntheticGenEvalReward", help="a reward class of modules/rewards/ or "
                        "modules/rewards/preference.py")
    parser.add_argument("--reward-path", default=None, help="its folder (PickScore, HPSv21, LaionAesthetic)")
    parser.add_argument("--batch", type=int, default=16, help="videos per reward call")
    parser.add_argument("--size", type=int, nargs=3, default=(5, 32, 32), metavar=("F", "H", "W"))
    parser.add_argument("--encoding", choices=("float32", "uint8"), default="float32")
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--per-block", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=6, help="flow_grpo iterations for the waiting share (0: skip)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; reward {args.reward}, batch "
          f"{args.batch} of {args.size[0]}x{args.size[1]}x{args.size[2]}, {args.encoding} on the wire")
    process, url = start_server(args.reward, args.reward_path)
    try:
        local = local_reward(args.reward, args.reward_path)
        remote = RemoteReward(url, encoding=args.encoding)
        media = torch.rand(args.batch, 3, *args.size, generator=torch.Generator().manual_seed(0)) * 2 - 1
        prompts = [PROMPTS[i % 2] for i in range(args.batch)]
        blocks = interleave(lambda: score(local, media, prompts), lambda: score(remote, media, prompts),
                            args.blocks, args.per_block, names=("local", "remote"))
        result = compare(blocks, unit="ms", per="batch", ratio_name="remote/local time per batch")
        print("1. reward throughput, same reward in this process (local) and behind serve-reward (remote)")
        print(result.report())
        for side in ("local", "remote"):
            seconds = statistics.median(s.wall for s in blocks.samples[side])
            print(f"  {side}: {args.batch / seconds:.1f} videos/s (wall)")

        if args.iterations:
            cfg = parse(os.path.join(ROOT, "configs", "flow_grpo.yaml"), "bench")
            method = instantiate_part(cfg, "model", "configs/flow_grpo.yaml", "bench")
            method.reward = RemoteReward(url, encoding=args.encoding)
            times = IterationTimes(method.reward)
            Trainer(accelerator="cpu", devices=1, max_steps=args.iterations, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                    limit_val_batches=0, callbacks=[times]).fit(method, Prompts(prompts=PROMPTS, batch_size=2))
            rows = times.rows[1:] or times.rows  # the first iteration also builds caches
            share = statistics.median(w / t for t, w in rows)
            print(f"2. flow_grpo ({len(rows)} iterations of 2 prompts x K={method.grpo.num_samples_per_prompt}, "
                  f"{method.video.frames}x{method.video.height}x{method.video.width}): "
                  f"{statistics.median(t for t, _ in rows) * 1e3:.0f} ms per iteration, of which waiting on the "
                  f"reward server {statistics.median(w for _, w in rows) * 1e3:.1f} ms: share {share:.1%}")
    finally:
        process.kill()
        process.wait()
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
