"""ShardedExpertsStrategy: DeepSpeed ZeRO engines for sharded experts beside DDP, on 2 CPU processes.

Every run is the real ``posttrain fit`` command (2 processes over gloo, tiny Wan preset, 32x32x5
videos, 4 iterations, a checkpoint every 2). Runs are shared between tests through ``runs``.
"""
from __future__ import annotations

import copy
import os
import re
from unittest import mock

import pytest
import torch
import yaml

import helpers_strategy as h
import launch
from posttrain.datamodules.synthetic import SyntheticVideos
from posttrain.modules.io import checkpoints
from posttrain.modules.io.media import slug
from posttrain.lit.base import RunArgs

pytestmark = pytest.mark.timeout(900)


class Runs:
    """Each named run once per session, on demand: ``runs["z3"]`` -> its folder."""

    def __init__(self, root):
        self.root, self.done = root, {}

    def __getitem__(self, name: str) -> str:
        if name not in self.done:
            folder = str(self.root / name)
            kwargs = RUNS[name]
            result = h.fit(h.config(folder, **kwargs))
            assert result.returncode == 0, f"run {name} failed:\n{result.stderr[-6000:]}"
            self.done[name] = folder
        return self.done[name]


TWO = {"model": "helpers_strategy.TwoExperts", "experts": {"critic": h.expert(None)}}
# sample videos shared by the ranks (3 prompts: 2 on rank 0, 1 and a repeat on rank 1), gathered to rank 0, which
# writes: under DDP, and from a ZeRO-3 engine that must gather its weights with every rank in each forward
SAMPLES = [{"class_path": "posttrain.callbacks.samples.SampleVideos",
            "init_args": {"every_n_iterations": 2, "num_prompts": 3}}]
RUNS = {
    "ddp": dict(zero_stage=None, ema_decay=0.9, callbacks=SAMPLES),
    "z2": dict(zero_stage=2, ema_decay=0.9),
    "z3": dict(zero_stage=3, ema_decay=0.9),
    "two": dict(zero_stage=3, callbacks=SAMPLES, **TWO),
}


@pytest.mark.slow
@pytest.mark.parametrize("run", ["ddp", "two"])
def test_sample_videos_under_ddp_and_zero3(runs, run):
    """Samples at iterations 2 and 4 (the end adds none: 4 was just sampled), written once (rank 0), without a hang:
    the data's first 3 validation captions, each rank's share gathered in order."""
    samples = sorted(os.listdir(os.path.join(runs[run], "samples")))
    assert [s[:8] for s in samples] == ["it000002"] * 3 + ["it000004"] * 3, samples
    prompts = SyntheticVideos(num_samples=16, batch_size=2).sample_prompts(3)  # the runs' data (helpers_strategy)
    assert samples == sorted(f"it{it:06d}_{i}_{slug(p)}.gif" for it in (2, 4) for i, p in enumerate(prompts))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("strategy_runs"))


def resuming(folder):
    """The checkpoint callback the runs were written with (Lightning restores its state on resume), saving into
    ``folder``: a resumed fit leaves the shared runs as written."""
    from posttrain.callbacks.checkpoints import ModelCheckpoint

    return ModelCheckpoint(dirpath=str(folder), **h.CHECKPOINTS)


def assert_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys() and len(a) > 0
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, f"max weight difference {worst} > {atol}"


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and len(a) > 0
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"


# ---------------------------------------------------------------------- same math, sharded
@pytest.mark.slow
@pytest.mark.parametrize("stage", ["z2", "z3"])
def test_zero_matches_ddp(runs, stage):
    """ZeRO-2/3 finetune ends where plain DDP does: generator and its EMA (a sync plan that gathers
    ZeRO-3 shards). The generator moved (it differs from its lagging EMA)."""
    ddp, zero = h.last(runs["ddp"]), h.last(runs[stage])
    assert not os.path.exists(os.path.join(ddp, "sharded.json")) and os.path.isfile(os.path.join(zero, "sharded.json"))
    for component in ("transformer", "transformer_ema"):
        assert_close(h.weights(zero, component), h.weights(ddp, component), atol=5e-5)
    trained, ema = h.weights(zero, "transformer"), h.weights(zero, "transformer_ema")
    assert max((trained[k] - ema[k]).abs().max().item() for k in trained) > 1e-4
    with open(os.path.join(zero, "sharded.json")) as f:
        meta = yaml.safe_load(f)
    assert meta["transformer"]["stage"] == int(stage[1]) and meta["transformer"]["world_size"] == 2
    shards = os.listdir(os.path.join(zero, "transformer", "zero"))
    assert sorted(s for s in shards if "optim_states" in s) == [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]


# ---------------------------------------------------------------------- exact resume
@pytest.mark.slow
def test_sharded_and_plain_experts_kill_resume_is_exact(runs, tmp_path):
    """TwoExperts: ``transformer`` in a ZeRO-3 engine, ``critic`` under DDP, each with its optimizer.
    The critic lives in the Lightning state (DDP ignores only the engine's parameters); a run killed
    after iteration 3 and resumed from iteration 2 ends bitwise equal to the uninterrupted one."""
    full = h.last(runs["two"])
    state = checkpoints.load(full, gather=False)  # the Lightning state as written (no shards gathered into it)
    keys = state["state_dict"].keys()
    assert any(k.startswith("card.models.critic.") for k in keys)
    assert not any(k.startswith("card.models.transformer.") for k in keys)
    assert len(state["optimizer_states"]) == 1  # the critic's; the transformer's is in its ZeRO shards
    assert state["posttrain_versions"]["critic"] == 4 and state["posttrain_versions"]["transformer"] == 4
    folder = h.kill_and_resume(str(tmp_path / "resumed"), **RUNS["two"])
    for component in ("transformer", "critic"):
        assert_equal(h.weights(h.last(folder), component), h.weights(full, component))


# ---------------------------------------------------------------------- multi-node
@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_two_nodes_train_as_one_world(runs, tmp_path, launcher):
    """``trainer.num_nodes: 2, devices: 1`` started as 2 "nodes" on 127.0.0.1 — by two ``torchrun --nnodes 2
    --node-rank i`` meeting on a free port, or as the two tasks of an ``srun`` (its ``SLURM_*`` variables) — is one
    world of 2 processes: its ZeRO-2 checkpoint at iteration 2 holds the weights, and its shards the world size,
    of the same config on one node with ``devices: 2``."""
    folder = str(tmp_path / launcher)
    done = h.fit_on_nodes(h.config(folder, zero_stage=2, max_steps=2, devices=1, num_nodes=2, ema_decay=0.9), launcher)
    for node, result in enumerate(done):
        assert result.returncode == 0, f"node {node} failed:\n{result.stderr[-5000:]}"
    ckpt = h.last(folder)
    with open(os.path.join(ckpt, "sharded.json")) as f:
        assert yaml.safe_load(f)["transformer"]["world_size"] == 2
    one_node = os.path.join(runs["z2"], "ckpt", ".last", "epoch=0-step=2.ckpt")
    for component in ("transformer", "transformer_ema"):
        assert_equal(h.weights(ckpt, component), h.weights(one_node, component))


# ---------------------------------------------------------------------- export
@pytest.mark.slow
def test_export_from_zero3_checkpoint(runs, tmp_path):
    from diffusers import WanTransformer3DModel

    from posttrain.lit.tools.cli import main

    out = str(tmp_path / "exported")
    main(["export", "--ckpt", h.last(runs["z3"]), "--out", out, "--expert", "transformer"])  # the whole pipeline
    model = WanTransformer3DModel.from_pretrained(out, subfolder="transformer")
    exported = {k: v.float() for k, v in model.state_dict().items()}
    assert_equal(exported, h.weights(h.last(runs["z3"]), "transformer"))
    assert_close(exported, h.weights(h.last(runs["ddp"]), "transformer"), atol=5e-5)  # independent of zero_to_fp32


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["export", "estimate"])
def test_the_tools_that_run_deepspeed_are_as_quiet_as_fit(runs, tmp_path, tool):
    """``export`` of a ZeRO checkpoint and ``estimate`` of a sharded config import DeepSpeed, which probes for an
    accelerator and warns that it fell back to the CPU unless told: the tools tell it (they run its CPU-side code)."""
    args = ["export", "--ckpt", h.last(runs["z2"]), "--out", str(tmp_path / "out")] if tool == "export" else \
        ["estimate", "--config", os.path.join(h.ROOT, "configs", "finetune_zero.yaml")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([h.ROOT, os.environ.get("PYTHONPATH", "")])}
    env.pop("DS_ACCELERATOR", None)
    done = launch.posttrain(*args, cwd=str(tmp_path), env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "real_accelerator" not in output and "Setting accelerator" not in output, output[:2000]


# ---------------------------------------------------------------------- a real full disk, two processes
@pytest.mark.slow
def test_a_sharded_write_that_fails_part_way_stops_every_process_alike(runs, tmp_path):
    """The ZeRO-2 run resumed under a file-size limit smaller than its shards (both processes inherit it): the next
    save fails part-way in DeepSpeed's own shard writes on both. Both stop with one message naming the checkpoint,
    the cause and the fix, without a hang; the temporary folder is gone; the earlier checkpoints and ``last`` are
    byte-identical."""
    import shutil

    folder = str(tmp_path / "resumed")
    shutil.copytree(os.path.join(runs["z2"], "ckpt"), os.path.join(folder, "ckpt"), symlinks=True)
    before, target = files_of(os.path.join(folder, "ckpt")), checkpoints.last_target(os.path.join(folder, "ckpt"))
    done = h.fit(h.config(folder, **{**RUNS["z2"], "max_steps": 6}), "--ckpt_path", "last",
                 max_file_bytes=256 << 10)  # the shards are ~0.6-0.9 MiB each
    assert done.returncode != 0 and "posttrain fit: error:" in done.stderr, done.stderr[-3000:]
    message = done.stderr[done.stderr.index("posttrain fit: error:"):]
    # torch's C++ file writer (DeepSpeed's shards) carries no OS error: the process's file-size limit names the cause
    assert re.search(r"writing checkpoint '\S+/ckpt/\.last/epoch=\d+-step=6\.ckpt' failed on process \d \(a file "
                     r"write stopped part-way \(torch: unexpected pos \d+ vs \d+\)\); the earlier checkpoints are "
                     r"unchanged", message), message
    assert f"at most {256 << 10} bytes" in message and "raise that limit" in message, message
    # each process says it, in the same words (the message and the traceback hint)
    assert message.count("posttrain fit: error:") == 2 and len(set(message.splitlines()) - {""}) == 2, message
    hidden = os.path.join(folder, "ckpt", checkpoints.HIDDEN)
    assert not [n for n in os.listdir(hidden) if n.startswith(checkpoints.TEMP_PREFIX)], os.listdir(hidden)
    assert files_of(os.path.join(folder, "ckpt")) == before
    assert checkpoints.last_target(os.path.join(folder, "ckpt")) == target


def files_of(folder: str) -> dict[str, dict]:
    return {rel: checkpoints.hash_file(os.path.join(folder, rel)) for rel in checkpoints.files_under(folder)
            if rel != checkpoints.FAILED}


# ---------------------------------------------------------------------- clear errors
@pytest.mark.slow
def test_config_parses():
    """configs/finetune_zero.yaml instantiates the strategy and a ZeRO-2 transformer as written."""
    from posttrain.lit.tools.config import PosttrainCLI
    from posttrain.lit.engine.strategy import ShardedExpertsStrategy

    cli = PosttrainCLI(args=["--config", os.path.join(h.ROOT, "configs", "finetune_zero.yaml")], run=False)
    assert isinstance(cli.trainer.strategy, ShardedExpertsStrategy)
    spec = cli.model.card.specs["transformer"]
    assert spec.sharded and spec.zero.stage == 2 and spec.trainable
    assert not any(s.sharded for name, s in cli.model.card.specs.items() if name != "transformer")


def _fit_in_process(card_experts: dict, strategy, ckpt_path=None, callbacks=(), max_steps=1, num_samples=4):
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from posttrain.datamodules.synthetic import SyntheticVideos
    from posttrain.lit.finetune import Finetune
    from posttrain.modules.models.cards import Expert, ModelCard, ZeroConfig

    experts = {}
    for name, spec in card_experts.items():
        spec = copy.deepcopy(spec)
        if "zero" in spec:
            spec["zero"] = ZeroConfig(**spec["zero"])
        if "optimizer" in spec:
            spec["optimizer"] = lambda params: torch.optim.AdamW(params, lr=1e-3)
        experts[name] = Expert(**spec)
    model = Finetune(ModelCard(experts), ema_decay=0.9, run=RunArgs(**h.SIZE))
    callbacks = list(callbacks)
    trainer = Trainer(max_steps=max_steps, accelerator="cpu", devices=1, strategy=strategy, logger=False,
                      enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                      enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks)
    trainer.fit(model, SyntheticVideos(num_samples=num_samples, batch_size=2, **h.SIZE), ckpt_path=ckpt_path)
    return trainer


def card(stage=None, **zero) -> dict:
    transformer = h.expert(stage)
    if stage is not None:
        transformer["zero"] = {"stage": stage, **zero}
    return {"text_encoder": {"arch": "umt5"}, "vae": {"arch": "wan_vae"}, "transformer": transformer}


@pytest.mark.slow
def test_sharded_expert_needs_the_sharding_strategy():
    with pytest.raises(ValueError, match=r"experts \['transformer'\] have `sharded: true`.*"
                                         r"posttrain.lit.engine.strategy.ShardedExpertsStrategy"):
        _fit_in_process(card(2), strategy="auto")


@pytest.mark.slow
def test_zero_config_rejected_by_deepspeed():
    from posttrain.lit.engine.strategy import validate_zero_configs
    from posttrain.modules.models.cards import Expert, ModelCard, ZeroConfig

    bad = ModelCard({"transformer": Expert(arch="wan_t2v", trainable=True, optimizer=torch.optim.AdamW,
                                           sharded=True, zero=ZeroConfig(stage=2, offload_params=True,
                                                                         extra={"zero_optimization": {
                                                                             "reduce_bucket_size": "big"}}))})
    with pytest.raises(ValueError) as err:
        validate_zero_configs(bad)
    message = str(err.value)
    assert "offload_params needs stage 3" in message
    assert "DeepSpeed rejects" in message and "reduce_bucket_size" in message and "'transformer'" in message


@pytest.mark.slow
def test_resume_with_other_stage_is_refused(runs, one_process, tmp_path):
    with pytest.raises(ValueError, match=r"expert 'transformer': checkpoint has ZeRO stage 3, this run 2"):
        _fit_in_process(card(2), one_process(), ckpt_path=h.last(runs["z3"]), callbacks=[resuming(tmp_path)])


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["z2", "z3"])
def test_two_process_checkpoint_resumes_on_one_process(runs, one_process, stage, caplog, tmp_path):
    """A ZeRO-2/3 checkpoint written by 2 processes at iteration 2 resumes on 1 with no conversion by hand: its shards
    are converted to DeepSpeed's universal checkpoint and resharded; the weights that arrive equal the checkpoint's
    bitwise; training continues to iteration 3; the data position carries over exactly (2 -> 1 always divides), and
    both are said; the checkpoint stays as written, with no temporary folder left beside it."""
    import logging

    from lightning.pytorch import Callback

    written = os.path.join(runs[stage], "ckpt", ".last", "epoch=0-step=2.ckpt")
    files = {rel: checkpoints.hash_file(os.path.join(written, rel)) for rel in checkpoints.files_under(written)}
    beside = sorted(os.listdir(os.path.dirname(written)))
    saved = h.weights(written, "transformer")
    loaded = {}

    class Loaded(Callback):
        def on_train_start(self, trainer, pl_module):
            import deepspeed

            module = pl_module.card.models["transformer"]
            with deepspeed.zero.GatheredParameters(list(module.parameters())):
                loaded.update({k: v.detach().clone().float() for k, v in module.named_parameters()})

    logging.getLogger("lightning.pytorch").addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO), pytest.warns(UserWarning, match="The dirpath has changed"):
            trainer = _fit_in_process(card(int(stage[1])), one_process(), ckpt_path=written,
                                      callbacks=[Loaded(), resuming(tmp_path)],
                                      max_steps=3, num_samples=16)
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(caplog.handler)
    assert trainer.global_step == 3 and torch.isfinite(trainer.logged_metrics["train/grad_norm/transformer"])
    assert_equal(loaded, saved)
    said = caplog.text
    assert "written by 2 processes, on 1: the ZeRO shards of ['transformer'] were converted" in said, said[-3000:]
    assert "stopped after 8 samples of epoch 0 (2 processes x batch 2); this run has 1 x 2: epoch 0 continues " \
           "after exactly those samples" in said, said[-3000:]
    assert {rel: checkpoints.hash_file(os.path.join(written, rel)) for rel in checkpoints.files_under(written)} == files
    assert sorted(os.listdir(os.path.dirname(written))) == beside


@pytest.mark.slow
def test_resume_with_other_expert_set_is_refused(runs, one_process, tmp_path):
    """The DDP-run card (transformer not sharded) differs from the ZeRO-3 checkpoint's."""
    with pytest.raises(ValueError, match=r"expert 'transformer' differs: checkpoint .*'sharded': True"), \
            pytest.warns(UserWarning, match=r"no expert has `sharded: true`; every expert runs under plain DDP"):
        _fit_in_process(card(None), one_process(), ckpt_path=h.last(runs["z3"]), callbacks=[resuming(tmp_path)])


@pytest.mark.slow
def test_frozen_zero3_expert_bf16_and_offload(one_process):
    """One card with every other option: a frozen ZeRO-3 text encoder (an inference engine, rebuilt on
    resume, never checkpointed) and a bf16 ZeRO-3 transformer with optimizer and parameter CPU offload.
    Two iterations count two, and the engine's gradient norm is logged per expert."""
    from lightning.pytorch import Trainer

    from posttrain.datamodules.synthetic import SyntheticVideos
    from posttrain.lit.finetune import Finetune
    from posttrain.modules.models.cards import Expert, ModelCard, ZeroConfig

    experts = {
        "text_encoder": Expert(arch="umt5", sharded=True, zero=ZeroConfig(stage=3)),
        "vae": Expert(arch="wan_vae"),
        "transformer": Expert(arch="wan_t2v", trainable=True, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                              sharded=True, zero=ZeroConfig(stage=3, precision="bf16", offload_optimizer=True,
                                                            offload_params=True)),
    }
    model = Finetune(ModelCard(experts), run=RunArgs(**h.SIZE))
    strategy = one_process()
    trainer = Trainer(max_steps=2, accelerator="cpu", devices=1, strategy=strategy, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model, SyntheticVideos(num_samples=4, batch_size=2, **h.SIZE))
    assert trainer.global_step == 2
    assert sorted(strategy.engines) == ["text_encoder", "transformer"] and list(strategy.trained_engines) == [
        "transformer"]
    assert next(model.card["transformer"].parameters()).dtype == torch.bfloat16
    assert torch.isfinite(trainer.logged_metrics["train/grad_norm/transformer"])


@pytest.mark.slow
def test_a_damaged_zero_shard_is_refused_and_last_falls_back(runs, tmp_path):
    """A ZeRO shard of the newest checkpoint with flipped bytes: verifying it names the shard file (before
    DeepSpeed reads anything), and ``last`` falls back to the earlier checkpoint, saying so."""
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(os.path.join(runs["z3"], "ckpt"), folder, symlinks=True)
    newest = checkpoints.last_target(str(folder))
    shards = [rel for rel in checkpoints.files_under(newest)
              if rel.startswith("transformer/zero/") and "optim_states" in rel]
    assert shards, checkpoints.files_under(newest)
    with open(os.path.join(newest, shards[0]), "r+b") as f:
        f.seek(os.path.getsize(f.name) // 2)
        f.write(bytes(b ^ 0xFF for b in f.read(4096)))
    with pytest.raises(checkpoints.CheckpointError, match=re.escape(shards[0]) + r": content differs from the "):
        checkpoints.verify(newest)
    said = []
    chosen = checkpoints.resolve_last(str(folder), said.append)
    assert chosen is not None and chosen != newest and os.path.basename(chosen) == "epoch=0-step=2.ckpt", (chosen, said)
    assert any("verifies instead" in line and shards[0] in line for line in said), said


@pytest.mark.slow
def test_full_disk_during_a_sharded_save_keeps_the_earlier_checkpoint(one_process, tmp_path, monkeypatch):
    """ENOSPC while the ZeRO-3 checkpoint's Lightning state is written: every process stops the save with the
    folder named and the fix, the temporary folder is removed, and the checkpoint saved before is as it was."""
    import errno

    from lightning.pytorch import Callback

    def full(*_, **__):
        raise OSError(errno.ENOSPC, "No space left on device")

    class Saves(Callback):
        def on_train_batch_end(self, trainer, *_):
            trainer.save_checkpoint(str(tmp_path / "good.ckpt"))
            self.before = {rel: checkpoints.hash_file(str(tmp_path / "good.ckpt" / rel)) for rel in
                           checkpoints.files_under(str(tmp_path / "good.ckpt"))}
            with monkeypatch.context() as patch:
                patch.setattr(checkpoints, "save_state", full)
                full_disk = r"bad.ckpt' failed \(No space left on device\); the earlier checkpoints are unchanged"
                with pytest.raises(checkpoints.CheckpointError, match=full_disk):
                    trainer.save_checkpoint(str(tmp_path / "bad.ckpt"))

    saves = Saves()
    _fit_in_process(card(3), one_process(), callbacks=[saves])
    assert sorted(os.listdir(tmp_path)) == ["good.ckpt"]
    checkpoints.verify(str(tmp_path / "good.ckpt"))
    assert {rel: checkpoints.hash_file(str(tmp_path / "good.ckpt" / rel)) for rel in
            checkpoints.files_under(str(tmp_path / "good.ckpt"))} == saves.before


@pytest.mark.slow
def test_zero3_experts_from_stored_weights_are_built_partitioned(one_process, tmp_path):
    """A ZeRO-3 expert with stored weights is built from its folder's config under ``zero.Init`` (partitioned
    from construction, never whole on a process) and filled module by module from the safetensors: a
    ``pretrained`` Wan transformer saved in several shards, and the shipped UMT5 (tied embeddings). When
    training starts, the gathered weights equal ``from_pretrained``'s bitwise."""
    from lightning.pytorch import Callback, Trainer

    from posttrain.datamodules.synthetic import SyntheticVideos
    from posttrain.lit.finetune import Finetune
    from posttrain.modules.models import presets
    from posttrain.modules.models.cards import Expert, ModelCard, ZeroConfig

    torch.manual_seed(3)
    presets.build_model("wan_t2v", preset=h.TINY_WAN).save_pretrained(tmp_path / "wan", max_shard_size="200KB")
    assert len(presets.weight_files(str(tmp_path / "wan"))) > 1  # an index and its shards
    references = {"transformer": presets.model_class("wan_t2v").from_pretrained(tmp_path / "wan"),
                  "text_encoder": presets.model_class("umt5").from_pretrained(presets.TRAINED_ASSETS["umt5"])}
    built_whole = []

    class Compare(Callback):
        def on_train_start(self, trainer, pl_module):
            import deepspeed

            for name, reference in references.items():
                model = pl_module.card.models[name]  # the model itself (its engine stays with the strategy)
                engine = trainer.strategy.engines[name]
                assert engine.module is model and pl_module.card[name].runner is engine  # forward runs the engine
                params = list(model.parameters())
                assert all(hasattr(p, "ds_id") for p in params)
                with deepspeed.zero.GatheredParameters(params):
                    got = dict(model.named_parameters())
                    differ = [k for k, v in reference.named_parameters() if not torch.equal(v, got[k])]
                    assert not differ, (name, differ[:3])

    def refuse_whole(*args, **kwargs):
        built_whole.append(args)
        raise AssertionError("a ZeRO-3 expert was built whole")

    experts = {
        "text_encoder": Expert(arch="umt5", sharded=True, zero=ZeroConfig(stage=3)),
        "vae": Expert(arch="wan_vae"),
        "transformer": Expert(arch="wan_t2v", pretrained=str(tmp_path / "wan"), trainable=True,
                              optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), sharded=True,
                              zero=ZeroConfig(stage=3)),
    }
    model = Finetune(ModelCard(experts), run=RunArgs(**h.SIZE))
    trainer = Trainer(max_steps=1, accelerator="cpu", devices=1, strategy=one_process(), logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Compare()])
    with mock.patch.object(presets.model_class("wan_t2v"), "from_pretrained", refuse_whole), \
            mock.patch.object(presets.model_class("umt5"), "from_pretrained", refuse_whole):
        trainer.fit(model, SyntheticVideos(num_samples=2, batch_size=2, **h.SIZE))
    assert trainer.global_step == 1 and not built_whole


@pytest.mark.slow
def test_resume_at_other_world_size_from_universal_checkpoint(runs, one_process, tmp_path):
    """Follow the error's instructions: convert the 2-process ZeRO-3 shards with ds_to_universal, set
    ``load_universal``, resume on 1 process: the weights arrive exactly and training goes on."""
    import shutil
    import subprocess
    import sys

    from lightning.pytorch import Callback, Trainer

    from posttrain.datamodules.synthetic import SyntheticVideos
    from posttrain.lit.finetune import Finetune
    from posttrain.modules.models.cards import Expert, ModelCard, ZeroConfig

    ckpt = str(tmp_path / "last.ckpt")
    shutil.copytree(h.last(runs["z3"]), ckpt)
    shards = os.path.join(ckpt, "transformer")
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    os.path.join(shards, "zero"), "--output_folder", os.path.join(shards, "zero_universal")],
                   check=True, capture_output=True)
    saved = h.weights(h.last(runs["z3"]), "transformer")
    loaded = {}

    class Loaded(Callback):
        def on_train_start(self, trainer, pl_module):
            import deepspeed

            module = pl_module.card.models["transformer"]
            with deepspeed.zero.GatheredParameters(list(module.parameters())):
                loaded.update({k: v.detach().clone() for k, v in module.named_parameters()})

    transformer = Expert(arch="wan_t2v", preset=h.TINY_WAN, trainable=True, sharded=True,  # the runs' architecture
                         optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01),
                         zero=ZeroConfig(stage=3, extra={"checkpoint": {"load_universal": True}}))
    model = Finetune(ModelCard({"text_encoder": Expert(arch="umt5"), "vae": Expert(arch="wan_vae"),
                                "transformer": transformer}), ema_decay=0.9, run=RunArgs(**h.SIZE))
    trainer = Trainer(max_steps=5, accelerator="cpu", devices=1, strategy=one_process(), logger=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      num_sanity_val_steps=0, callbacks=[Loaded(), resuming(tmp_path / "resumed")])
    with pytest.warns(UserWarning, match="The dirpath has changed"):  # the copy resumes into a folder of its own
        trainer.fit(model, SyntheticVideos(num_samples=16, batch_size=2, **h.SIZE), ckpt_path=ckpt)
    assert_equal(loaded, saved)
    assert trainer.global_step == 5
