"""Checkpoint write time: posttrain's atomic, hashed checkpoint folder vs Lightning's own write, same run.

The checkpoint is the default finetune's (configs/finetune.yaml as shipped: its card, AdamW state, EMA copy)
after two iterations, as Lightning's checkpoint connector dumps it. Two writers save it into the same folder on
the same disk, interleaved (ABAB…, then BABA… to cancel drift), ``--repeats`` times each; medians are compared:

- baseline: Lightning's ``TorchCheckpointIO.save_checkpoint`` (what ``ModelCheckpoint`` used before): the
  pickle in memory, then one ``write`` to ``<name>.ckpt``; no fsync, no rename, no hash;
- posttrain: ``modules.checkpoints.write_checkpoint`` + ``link_last``: temporary folder, ``lightning.pt`` hashed
  (SHA-256) while written, fsync, manifest, fsync, rename, fsync of the folder, ``last.ckpt`` switched;
- for the split, a bare atomic write: ``torch.save`` to a temporary name, fsync, rename, fsync of the folder
  (durability without hash, manifest or link).

    python -m bench.checkpoint_write [--repeats 30] [--folder runs/bench_checkpoint]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import torch  # noqa: E402
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402

from posttrain.modules.io import checkpoints  # noqa: E402
from posttrain.lit.tools.config import PosttrainCLI  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "finetune.yaml")


def default_finetune_checkpoint(workdir: str) -> dict:
    cli = PosttrainCLI(args=[
        "--config", CONFIG, "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.logger=false",
        "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]",
        f"--trainer.default_root_dir={workdir}",
    ], run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    return cli.trainer._checkpoint_connector.dump_checkpoint()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--folder", default="runs/bench_checkpoint",
                        help="where the checkpoints are written (a real disk, not tmpfs: fsync is measured)")
    args = parser.parse_args()
    os.makedirs(args.folder, exist_ok=True)
    folder = tempfile.mkdtemp(dir=args.folder)
    checkpoint = default_finetune_checkpoint(folder)
    baseline_io = TorchCheckpointIO()

    def baseline(i: int) -> None:
        baseline_io.save_checkpoint(checkpoint, os.path.join(folder, f"epoch=0-step={i}.ckpt"))

    def posttrain(i: int) -> None:
        path = os.path.join(folder, f"epoch=0-step={i}-p.ckpt")
        checkpoints.write_checkpoint(checkpoint, path)
        checkpoints.link_last(folder, path)

    def atomic(i: int) -> None:
        path = os.path.join(folder, f"epoch=0-step={i}-a.ckpt")
        temp = path + ".tmp"
        torch.save(checkpoint, temp)
        with open(temp, "rb+") as f:
            os.fsync(f.fileno())
        os.rename(temp, path)
        checkpoints.fsync_dir(folder)

    times: dict[str, list[float]] = {"baseline": [], "posttrain": [], "atomic": []}
    writers = {"baseline": baseline, "posttrain": posttrain, "atomic": atomic}
    for i in range(args.repeats):
        order = ["baseline", "posttrain", "atomic"] if i % 2 == 0 else ["atomic", "posttrain", "baseline"]
        for name in order:
            start = time.perf_counter()
            writers[name](i)
            times[name].append(time.perf_counter() - start)
        for entry in os.listdir(folder):  # outside the timing
            checkpoints.remove_entry(os.path.join(folder, entry))

    size = os.path.getsize(_one_state(folder, checkpoint))
    with open(os.path.join(folder, "x"), "rb") as f:
        data = f.read()
    start = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    hash_seconds = time.perf_counter() - start
    shutil.rmtree(folder)

    base, ours = statistics.median(times["baseline"]), statistics.median(times["posttrain"])
    bare = statistics.median(times["atomic"])
    print(f"checkpoint of the default finetune: {size / 2**20:.2f} MiB, {args.repeats} interleaved writes each")
    print(f"  Lightning TorchCheckpointIO (no fsync, no hash): median {base * 1e3:.1f} ms")
    print(f"  posttrain atomic + SHA-256 + fsync + link:       median {ours * 1e3:.1f} ms")
    print(f"  (split) torch.save + fsync + rename + fsync dir:  median {bare * 1e3:.1f} ms")
    print(f"  ratio {ours / base:.2f} against Lightning; {ours / bare:.2f} against the bare atomic write "
          f"(hashing {size / 2**20:.1f} MiB alone: {hash_seconds * 1e3:.1f} ms, {size / hash_seconds / 1e9:.2f} GB/s)")


def _one_state(folder: str, checkpoint: dict) -> str:
    path = os.path.join(folder, "x")
    torch.save(checkpoint, path)
    return path


if __name__ == "__main__":
    main()
