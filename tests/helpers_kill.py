"""Kill a real ``posttrain fit`` job at a chosen instant: the ``Chaos`` callback and the run/compare helpers of
tests/test_kill_anywhere.py.

A moment is one of
    ``iteration:<k>``            after iteration k (and its checkpoint, if one is due), before iteration k+1;
    ``write:<k>:<phase>``        inside the save of iteration k's checkpoint, at ``phase`` of the protocol in
                                 ``posttrain.modules.io.checkpoints`` (``start``, ``bytes`` = lightning.pt half written,
                                 ``shards``, ``torn`` = a ZeRO shard file half written, ``state``, ``manifest``,
                                 ``committed``, ``linked``);
    ``resume:<phase>``           during a resume: ``verified`` (checkpoint verified, nothing loaded yet) or
                                 ``started`` (everything restored, before the first iteration).
The whole job dies at once (SIGKILL to every process of it, as when a node goes down): ``launch.kill_job``.
"""
from __future__ import annotations

import os
import subprocess
from typing import Any

import torch
from lightning.pytorch import Callback

import launch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def die() -> None:
    launch.kill_job()


class Chaos(Callback):
    def __init__(self, moment: str):
        self.moment = moment
        kind, *rest = moment.split(":")
        self.kind = kind
        self.step = int(rest[0]) if kind in ("iteration", "write") else None
        self.phase = rest[-1] if kind in ("write", "resume") else None
        self.trainer = None
        self.byte_writes = 0

    def setup(self, trainer, pl_module, stage: str) -> None:
        from posttrain.modules.io import checkpoints

        self.trainer = trainer
        original = checkpoints.fault_point

        def fault_point(name: str) -> None:
            original(name)
            self.reached(name)

        checkpoints.fault_point = fault_point

    def reached(self, name: str) -> None:
        trainer = self.trainer
        if self.kind == "resume" and name == "load:verified" and self.phase == "verified":
            die()
        if self.kind != "write" or trainer is None or trainer.global_step != self.step:
            return
        if not trainer.state.fn == "fit" or trainer.sanity_checking:
            return
        if self.phase == "bytes" and name == "write:bytes":
            self.byte_writes += 1
            if self.byte_writes == 3:  # a few records of lightning.pt are on disk, the rest is not
                die()
        elif self.phase == "torn" and name == "write:start":
            self._tear_next_shard()
        elif name == f"write:{self.phase}":
            die()

    def _tear_next_shard(self) -> None:
        """The next file DeepSpeed saves is left half written when the job dies."""
        real_save = torch.save

        def save(obj: Any, f, *args, **kwargs):
            real_save(obj, f, *args, **kwargs)
            if isinstance(f, (str, os.PathLike)):
                with open(f, "r+b") as handle:
                    handle.truncate(os.path.getsize(f) // 2)
                die()

        torch.save = save

    def on_train_start(self, trainer, pl_module) -> None:
        if self.kind == "resume" and self.phase == "started" and trainer.ckpt_path is not None:
            die()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.kind == "iteration" and trainer.global_step == self.step:
            die()


def run(config: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``posttrain fit --config config *args`` as its own process group (so a kill takes all its processes)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]),
               WANDB_MODE="offline", OMP_NUM_THREADS="1")
    return launch.posttrain("fit", "--config", config, *args, cwd=ROOT, env=env, timeout=timeout)


# ---------------------------------------------------------------------- bitwise comparison
RUN_IDENTITY = "/lightning.pt/posttrain/run"  # which W&B run the checkpoint belongs to: two runs, two ids


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Every place where two loaded checkpoints differ (tensors bitwise, dtype included), but the run identity."""
    if path == RUN_IDENTITY:
        return []
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype \
                or a.shape != b.shape or not torch.equal(a, b):
            return [path]
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path} keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path} length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if type(a) is type(b) and hasattr(a, "__dict__") and not isinstance(a, type):  # e.g. DeepSpeed's LossScaler
        return differences(vars(a), vars(b), f"{path}.{type(a).__name__}")
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def checkpoint_contents(folder: str) -> dict[str, Any]:
    """Every file of a checkpoint folder, loaded (weights only, verified first); the Lightning state without
    the checkpoint callback's own bookkeeping (paths of this run's folder)."""
    from posttrain.modules.io import checkpoints

    checkpoints.verify(folder)
    contents: dict[str, Any] = {}
    for rel in checkpoints.files_under(os.path.realpath(folder)):
        path = os.path.join(os.path.realpath(folder), rel)
        if rel.endswith(".pt"):
            contents[rel] = checkpoints.load_state(path, deepspeed=rel != checkpoints.STATE)  # ZeRO shards
        elif rel.endswith(".safetensors"):  # a LoRA run's adapter/
            from safetensors.torch import load_file

            contents[rel] = load_file(path)
        elif rel != checkpoints.MANIFEST and not rel.endswith(".py"):
            with open(path) as f:
                contents[rel] = f.read()
    state = contents[checkpoints.STATE]
    state["callbacks"] = {k: v for k, v in state["callbacks"].items() if not k.startswith("ModelCheckpoint")}
    return contents
