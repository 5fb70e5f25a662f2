"""Helpers of tests/test_strategy.py: run configs, a kill switch, a two-expert method.

Runs go through the real ``posttrain fit`` command in its own process (tests/launch.py): Lightning's launcher then
starts the second process by re-running that command (it cannot re-run pytest). ``PYTHONPATH`` carries this
folder so that YAML ``class_path: helpers_strategy.…`` resolves in both processes.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from typing import Any, Callable, Optional

import torch
import yaml
from lightning.pytorch import Callback

import launch
from posttrain.lit.base import ExpertModule, RunArgs
from posttrain.modules.models.cards import ModelCard
from posttrain.modules.io.checkpoints import load as load_checkpoint
from posttrain.modules.flow.losses import flow_matching_loss, noised, sample_sigmas
from tests.conftest import TINY_WAN

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SIZE = {"frames": 5, "height": 32, "width": 32}
# where a launch puts a process: Lightning sets them in its own process, torchrun in each it starts
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
                    "GROUP_RANK", "TORCHELASTIC_RUN_ID")
ADAMW = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.001, "weight_decay": 0.01}}
CHECKPOINTS = {"every_n_train_steps": 2, "save_last": True, "save_top_k": 0}  # the runs' ModelCheckpoint


def expert(zero_stage: Optional[int], **extra) -> dict:
    """A trainable tiny Wan transformer; ``zero_stage=None`` keeps it under plain DDP."""
    spec: dict[str, Any] = {"arch": "wan_t2v", "preset": TINY_WAN, "trainable": True, "optimizer": ADAMW}
    if zero_stage is not None:
        spec.update(sharded=True, zero={"stage": zero_stage})
    return spec | extra


def config(root: str, zero_stage: Optional[int], max_steps: int = 4, devices: int = 2, num_nodes: int = 1,
           model: str = "posttrain.lit.finetune.Finetune", experts: Optional[dict] = None, callbacks: list = (),
           sharding_strategy: Optional[bool] = None, sequence_parallel: int = 1, **model_args) -> str:
    """Write a small fit config under ``root`` (checkpoints in ``root/ckpt`` every 2 iterations)."""
    sharding = zero_stage is not None if sharding_strategy is None else sharding_strategy
    cards = {"text_encoder": {"arch": "umt5"}, "vae": {"arch": "wan_vae"}, "transformer": expert(zero_stage)}
    cards.update(experts or {})
    cfg = {
        "seed_everything": 0,
        "trainer": {
            "max_steps": max_steps, "accelerator": "cpu", "devices": devices, "num_nodes": num_nodes,
            "strategy": {"class_path": "posttrain.lit.engine.strategy.ShardedExpertsStrategy",
                         **({"init_args": {"sequence_parallel": sequence_parallel}} if sequence_parallel > 1 else {})}
            if sharding else "ddp",
            "logger": False, "enable_progress_bar": False, "enable_model_summary": False,
            "limit_val_batches": 0, "num_sanity_val_steps": 0, "default_root_dir": root,
            "callbacks": [{"class_path": "posttrain.callbacks.checkpoints.ModelCheckpoint",
                           "init_args": {"dirpath": os.path.join(root, "ckpt"), **CHECKPOINTS}}, *callbacks],
        },
        "model": {"class_path": model, "init_args": {"card": {"experts": cards}, "run": SIZE, **model_args}},
        "data": {"class_path": "posttrain.datamodules.synthetic.SyntheticVideos",
                 "init_args": {"num_samples": 16, "batch_size": 2}},
    }
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "config.in.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def fit(config_path: str, *args: str, timeout: int = 240,
        max_file_bytes: Optional[int] = None) -> subprocess.CompletedProcess:
    """``posttrain fit --config config_path *args`` in a subprocess (2 processes when devices: 2); with
    ``max_file_bytes`` the command (and the processes it starts, which inherit the limit) cannot grow a file beyond
    it: a write past it fails with EFBIG part-way, as on a full disk."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]),
               WANDB_MODE="offline", OMP_NUM_THREADS="1")
    for name in LAUNCH_VARIABLES:  # left by a run in this process (Lightning sets them): the command picks its own
        env.pop(name, None)
    return launch.posttrain("fit", "--config", config_path, *args, cwd=ROOT, env=env, timeout=timeout,
                            max_file_bytes=max_file_bytes)


def last(folder: str) -> str:
    """The last checkpoint of a run written by ``config(folder, ...)``."""
    return os.path.join(folder, "ckpt", "last.ckpt")


def kill_and_resume(folder: str, between: Optional[Callable[[str], None]] = None, **settings) -> str:
    """``config(folder, **settings)`` killed in every process after iteration 3 (its last checkpoint: iteration 2),
    ``between(folder)`` then (to read that checkpoint), and resumed with ``--ckpt_path last`` to iteration 4."""
    kill = [{"class_path": "helpers_strategy.KillAfter", "init_args": {"iteration": 3}}]
    killed = fit(config(folder, **{**settings, "callbacks": [*settings.get("callbacks", []), *kill]}))
    assert killed.returncode != 0, "the kill switch did not fire"
    assert load_checkpoint(last(folder), gather=False)["global_step"] == 2
    if between is not None:
        between(folder)
    resumed = fit(config(folder, **settings), "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert load_checkpoint(last(folder), gather=False)["global_step"] == 4  # iterations, not engine or optimizer steps
    return folder


def close_process_group() -> None:
    """Tear down the process group a one-process strategy started in this pytest process, through DeepSpeed where it
    holds it: it then drops the groups it cached (its clone of the world), so a later one-process strategy in this
    process (an xdist worker runs the modules interleaved) builds fresh ones."""
    import deepspeed.comm

    if torch.distributed.is_initialized():
        if deepspeed.comm.comm.cdb is not None:
            deepspeed.comm.destroy_process_group()
        else:
            torch.distributed.destroy_process_group()
    deepspeed.comm.comm.cdb = None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fit_on_nodes(config_path: str, launcher: str, nodes: int = 2, timeout: int = 400) -> list[subprocess.CompletedProcess]:
    """``posttrain fit --config config_path`` as ``nodes`` "nodes" of one process each on 127.0.0.1, started the way a
    cluster starts them: ``torchrun --nnodes N --node-rank i`` (a static rendezvous on a free port), or by SLURM
    (``srun`` gives every task its ``SLURM_*`` variables; Lightning's SLURM environment reads them). All at once;
    the results in node order."""
    port = str(free_port())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]),
               WANDB_MODE="offline", OMP_NUM_THREADS="1")
    for name in LAUNCH_VARIABLES:
        env.pop(name, None)
    command = ["-m", "posttrain", "fit", "--config", config_path]
    started = []
    for node in range(nodes):
        if launcher == "torchrun":
            args = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node-rank={node}",
                    "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}", *command]
            node_env = env
        else:  # what srun --nodes N --ntasks-per-node 1 sets in task `node`
            args = [sys.executable, *command]
            node_env = dict(env, SLURM_NTASKS=str(nodes), SLURM_NTASKS_PER_NODE="1", SLURM_NNODES=str(nodes),
                            SLURM_PROCID=str(node), SLURM_LOCALID="0", SLURM_NODEID=str(node), SLURM_JOB_ID="4242",
                            SLURM_JOB_NAME="posttrain", SLURM_NODELIST="127.0.0.1", MASTER_PORT=port)
        started.append(subprocess.Popen(args, cwd=ROOT, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True))
    done = []
    for process in started:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in started:
                other.kill()
            raise
        done.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    return done


def weights(ckpt: str, component: str) -> dict[str, torch.Tensor]:
    """``component``'s full weights from a ``.ckpt`` file or a sharded checkpoint folder."""
    prefix = f"card.models.{component}."
    state = load_checkpoint(ckpt)["state_dict"]
    return {k[len(prefix):]: v.float() for k, v in state.items() if k.startswith(prefix)}


class KillAfter(Callback):
    """SIGKILL every process after ``iteration`` iterations: no teardown, no final checkpoint."""

    def __init__(self, iteration: int):
        self.iteration = iteration

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.iteration:
            os.kill(os.getpid(), signal.SIGKILL)


class TwoExperts(ExpertModule):
    """Test-only method with two trainable experts and two losses: the ``transformer`` regresses the
    flow-matching velocity; the ``critic`` (a second Wan) regresses the transformer's detached
    prediction, as a DMD2 fake-score critic does. One ``step_experts`` per expert."""

    def __init__(self, card: ModelCard, run: Optional[RunArgs] = None):
        super().__init__(card, run=run)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        x0 = self.stage.encode(batch["video"])
        cond = self.stage.condition(list(batch["prompt"]), self.device)
        sigma = sample_sigmas(x0.shape[0], "uniform", self.generator)
        noise = torch.randn(x0.shape, generator=self.generator)
        x_sigma = noised(x0, noise, sigma)
        # 1. generator: flow matching
        t = self.sampler.timestep_of(sigma)
        with self.stage.velocity("transformer") as velocity:
            v = velocity(x_sigma, t, cond)
        loss, _ = flow_matching_loss(v, x0, noise)
        self.step_experts(loss.mean(), ["transformer"])
        # 2. critic: regress the generator's (detached) velocity
        with self.stage.velocity("critic") as velocity:
            v_critic = velocity(x_sigma, t, cond)
        critic_loss = (v_critic.float() - v.detach().float()).pow(2).mean()
        self.step_experts(critic_loss, ["critic"])
        self.log("train/loss", loss.mean().detach(), on_step=True)
        return loss.mean().detach()


class RecordRollouts(Callback):
    """Save every rollout's per-step log p (``(T, B)``, captured in the rollout) and its log-probability gap (recomputed at the
    rollout's weights) to ``<folder>/rollout_<rank>_<iteration>.pt``."""

    def __init__(self, folder: str):
        self.folder = folder

    def on_rollout_captured(self, trainer, pl_module, probe) -> None:
        rollout = probe.__self__  # the probe is the rollout's bound ``logprob_gap``
        os.makedirs(self.folder, exist_ok=True)
        torch.save({"log_probs": rollout.traj.log_probs.detach().clone(), "gap": float(probe())},
                   os.path.join(self.folder, f"rollout_{trainer.global_rank}_{trainer.global_step}.pt"))


class RecordExitSteps(Callback):
    """Append ``<iteration> <exit step>`` of every iteration to ``<folder>/exit_<rank>.txt`` (a distillation
    method logs ``train/exit_step``, which must be the same on every process)."""

    def __init__(self, folder: str):
        self.folder = folder

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.callback_metrics.get("train/exit_step")
        with open(os.path.join(self.folder, f"exit_{trainer.global_rank}.txt"), "a") as f:
            f.write(f"{trainer.global_step} {None if step is None else int(step)}\n")


class RecordStudentGap(Callback):
    """At the start of a fresh run, write to ``<folder>/gap_<rank>.txt`` how far the student's velocity on a fixed
    input lies from the teacher's: ``<largest difference> <largest teacher value>`` (an ``init_from`` student that
    starts as its teacher's function reads a difference at float rounding, on every process); at the end of the
    run the same to ``end_gap_<rank>.txt``."""

    def __init__(self, folder: str):
        self.folder = folder

    def on_train_start(self, trainer, pl_module) -> None:
        if not trainer.global_step:
            self.record(trainer, pl_module, "gap")

    def on_train_end(self, trainer, pl_module) -> None:
        self.record(trainer, pl_module, "end_gap")

    def record(self, trainer, pl_module, name: str) -> None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn((1, *pl_module.stage.latent_shape(pl_module.video)), generator=g).to(pl_module.device)
        t = torch.full((1,), 500.0, device=pl_module.device)
        cond = pl_module.stage.condition(["a red circle moving left"], pl_module.device)
        with torch.no_grad():
            with pl_module.stage.velocity("teacher") as teacher:
                v_teacher = teacher(x, t, cond).float()
            with pl_module.stage.velocity("transformer") as student:
                v_student = student(x, t, cond).float()
        with open(os.path.join(self.folder, f"{name}_{trainer.global_rank}.txt"), "w") as f:
            f.write(f"{(v_student - v_teacher).abs().max().item()} {v_teacher.abs().max().item()}\n")
