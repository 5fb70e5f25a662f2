"""Checkpoints refuse corruption, never run code, keep one unambiguous ``last`` and an exact data position.

(Kills at any instant: tests/test_kill_anywhere.py.)
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import warnings

import pytest
import torch
import yaml
from lightning.pytorch import Callback, seed_everything

import launch
from posttrain.datamodules.sampling import ResumableLoader, ResumableSampler
from posttrain.modules.io import checkpoints as ckpt
from posttrain.lit.base import RunArgs
from posttrain.lit.finetune import Finetune
from tests.conftest import adamw, wan_card
from tests.helpers import TwoExperts, fit_checkpointed
from posttrain.modules.models.cards import Expert

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = dict(frames=5, height=16, width=16)


def fit(folder, steps: int, ckpt_path=None, module=None, **kwargs):
    """A tiny finetune with the package's ModelCheckpoint in ``folder`` (``fit_checkpointed``: ``every``,
    ``save_top_k``, ``callbacks``, trainer settings); returns (module, trainer, warnings)."""
    module = module or Finetune(wan_card(), caption_dropout=0.0, ema_decay=0.9, run=RunArgs(**SIZE))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit_checkpointed(module, folder, steps, ckpt_path, num_samples=6, **kwargs)
    return module, trainer, [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One 6-iteration run: checkpoints at 2, 4, 6; ``last.ckpt`` -> the one of iteration 6."""
    folder = tmp_path_factory.mktemp("run") / "checkpoints"
    _, _, caught = fit(folder, 6)
    return folder, caught


def copy_run(run, tmp_path):
    import shutil

    folder = tmp_path / "checkpoints"
    shutil.copytree(run[0], folder, symlinks=True)
    return folder


def flip(file: str, offset_from_end: int = 4096 * 3, n: int = 4096) -> None:
    """Flip ``n`` bytes inside the file's tensor data (size unchanged)."""
    with open(file, "r+b") as f:
        size = os.path.getsize(file)
        f.seek(size - offset_from_end)
        data = bytearray(f.read(n))
        f.seek(size - offset_from_end)
        f.write(bytes(b ^ 0xFF for b in data))


# ---------------------------------------------------------------------- layout, last, no warnings
def test_checkpoints_are_verified_folders_and_last_is_one_link(run):
    folder, caught = run
    names = sorted(os.listdir(folder))
    assert names == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"], names
    assert os.path.islink(folder / "last.ckpt") and os.readlink(folder / "last.ckpt") == "epoch=1-step=6.ckpt"
    manifest = ckpt.verify(str(folder / "last.ckpt"))
    assert set(manifest["files"]) == {"lightning.pt"} and manifest["global_step"] == 6
    assert manifest["files"]["lightning.pt"]["size"] == os.path.getsize(folder / "last.ckpt" / "lightning.pt")
    # under manual optimization Lightning's ModelCheckpoint prints a 14-line warning at every save
    assert not [w for w in caught if "manual optimization" in w], caught


def test_rerun_in_the_same_folder_keeps_one_last(run, tmp_path):
    folder = copy_run(run, tmp_path)
    fit(folder, 4)  # a fresh run over the old one: same names, replaced atomically
    names = sorted(os.listdir(folder))
    assert "last-v1.ckpt" not in names and not any("-v1" in n for n in names), names
    assert os.readlink(folder / "last.ckpt") == "epoch=1-step=4.ckpt"
    assert ckpt.verify(str(folder / "last.ckpt"))["global_step"] == 4


def test_last_only_keeps_hidden_checkpoints(tmp_path):
    folder = tmp_path / "ckpt"
    fit(folder, 6, save_top_k=0)
    assert sorted(os.listdir(folder)) == [".last", "last.ckpt"]
    assert os.readlink(folder / "last.ckpt") == os.path.join(".last", "epoch=1-step=6.ckpt")
    assert sorted(os.listdir(folder / ".last")) == ["epoch=1-step=4.ckpt", "epoch=1-step=6.ckpt"]  # and a fallback


def test_resume_prints_no_resumability_warning(run, tmp_path):
    folder = copy_run(run, tmp_path)
    _, trainer, caught = fit(folder, 8, ckpt_path="last")
    assert trainer.global_step == 8
    noise = ("not resumable", "manual optimization", "exists and is not empty")
    assert not [w for w in caught if any(n in w for n in noise)], caught


def test_a_fit_that_ends_off_the_cadence_checkpoints_its_final_iteration_resumably(tmp_path):
    """max_steps 5 with a checkpoint every 2: Lightning's would leave ``last`` at iteration 4 and iteration 5 lost.
    Saved mid-loop like a cadence checkpoint, it resumes exactly: 5 then 3 more equals 8 straight."""
    seed_everything(0)
    fit(tmp_path / "ended", 5)
    assert sorted(os.listdir(tmp_path / "ended")) == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt",
                                                      "epoch=1-step=5.ckpt", "last.ckpt"]
    assert ckpt.verify(str(tmp_path / "ended" / "last.ckpt"))["global_step"] == 5
    seed_everything(0)
    resumed, _, _ = fit(tmp_path / "ended", 8, ckpt_path="last")
    seed_everything(0)
    straight, _, _ = fit(tmp_path / "straight", 8)
    a, b = resumed.state_dict(), straight.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Validations(Callback):
    """Records the iteration of every validation (and can crash in the one of ``crash_at``)."""

    def __init__(self, crash_at=None):
        self.seen, self.crash_at = [], crash_at

    def on_validation_start(self, trainer, pl_module):
        if trainer.sanity_checking:
            return
        if trainer.global_step == self.crash_at:
            raise RuntimeError("crash during validation")
        self.seen.append(trainer.global_step)


def test_validation_after_a_checkpoint_iteration_is_never_skipped(tmp_path):
    """A checkpoint due on an iteration that a validation follows is taken after that validation: a crash during
    the validation resumes from the previous checkpoint and validates again, instead of skipping it."""
    validate = dict(limit_val_batches=1, val_check_interval=2, check_val_every_n_epoch=None)
    straight = Validations()
    fit(tmp_path / "straight", 4, callbacks=[straight], **validate)
    assert straight.seen == [2, 4]
    assert ckpt.verify(str(tmp_path / "straight" / "last.ckpt"))["global_step"] == 4

    with pytest.raises(RuntimeError, match="crash during validation"):
        fit(tmp_path / "crashed", 4, callbacks=[Validations(crash_at=4)], **validate)
    assert ckpt.verify(str(tmp_path / "crashed" / "last.ckpt"))["global_step"] == 2
    resumed = Validations()
    fit(tmp_path / "crashed", 4, ckpt_path="last", callbacks=[resumed], **validate)
    assert resumed.seen == [4]


# ---------------------------------------------------------------------- corruption
@pytest.mark.parametrize("damage", ["truncated", "bit-flipped", "manifest missing", "extra file"])
def test_damaged_checkpoint_is_refused_naming_the_file(run, tmp_path, damage):
    folder = copy_run(run, tmp_path)
    target = folder / "epoch=1-step=6.ckpt"
    state = target / "lightning.pt"
    if damage == "truncated":
        with open(state, "r+b") as f:
            f.truncate(os.path.getsize(state) // 2)
        expected = r"lightning.pt: \d+ bytes, the manifest says \d+ \(truncated"
    elif damage == "bit-flipped":
        flip(str(state))
        expected = r"lightning.pt: content differs from the manifest \(sha256 mismatch"
    elif damage == "manifest missing":
        os.remove(target / "manifest.json")
        expected = r"epoch=1-step=6.ckpt: no manifest.json: an incomplete checkpoint"
    else:
        (target / "notes.pt").write_bytes(b"x")
        expected = r"notes.pt: not in the checkpoint's manifest"
    with pytest.raises(ckpt.CheckpointError, match=expected):
        ckpt.load(str(target))
    # an explicit path stops before anything loads
    module = Finetune(wan_card(), caption_dropout=0.0, ema_decay=0.9, run=RunArgs(**SIZE))
    with pytest.raises(ckpt.CheckpointError, match=expected):
        fit(tmp_path / "other", 8, ckpt_path=str(target), module=module)
    # `last` falls back to the newest checkpoint that verifies, and says so
    module, trainer, caught = fit(folder, 8, ckpt_path="last")
    said = [w for w in caught if "Resuming the newest checkpoint that verifies instead" in w]
    assert said and "epoch=1-step=4.ckpt" in said[0] and "epoch=1-step=6.ckpt" in said[0], caught
    assert trainer.global_step == 8 and module.card.versions["transformer"] == 8


def test_corrupt_last_with_nothing_to_fall_back_to_stops(tmp_path):
    folder = tmp_path / "ckpt"
    fit(folder, 2, every=2)
    flip(str(folder / "last.ckpt" / "lightning.pt"))
    with pytest.raises(ckpt.CheckpointError, match=r"no other checkpoint under .* verifies"):
        fit(folder, 4, ckpt_path="last")


def test_stale_temporary_checkpoint_is_never_resumed_and_is_cleaned(run, tmp_path):
    folder = copy_run(run, tmp_path)
    stale = folder / ".tmp-123-abcd-epoch=9-step=99.ckpt"  # a save that was killed half way
    stale.mkdir()
    (stale / "lightning.pt").write_bytes(b"torn")
    assert ckpt.resolve_last(str(folder), say=print).endswith("epoch=1-step=6.ckpt")
    fit(folder, 8, ckpt_path="last")
    assert not stale.exists()


def test_missing_last_link_resumes_the_newest_complete_checkpoint(run, tmp_path):
    folder = copy_run(run, tmp_path)
    os.remove(folder / "last.ckpt")  # killed between the commit of the first checkpoint and its link
    said = []
    assert ckpt.resolve_last(str(folder), say=said.append).endswith("epoch=1-step=6.ckpt")
    assert "is missing" in said[0]


def test_failed_run_is_named_when_last_resumes_it(tmp_path, monkeypatch):
    """A healthy run, then a fresh run in the same folder that stops on NaN losses: `last` now points at the
    failed run's checkpoint, and resuming it says so and names the healthy run's checkpoint."""
    card = lambda: wan_card(extra={"critic": Expert(arch="wan_t2v", trainable=True, optimizer=adamw())})  # noqa: E731
    folder = tmp_path / "ckpt"
    monkeypatch.setattr(ckpt, "RUN_ID", "healthy")
    fit(folder, 6, module=TwoExperts(card()))
    monkeypatch.setattr(ckpt, "RUN_ID", "failing")
    from posttrain.lit.base import NonFiniteLossError

    with pytest.raises(NonFiniteLossError):
        fit(folder, 20, module=TwoExperts(card(), nan_at=4, max_nan_steps=3), every=1)
    assert json.loads((folder / ckpt.FAILED).read_text())["error"].startswith("NonFiniteLossError")
    monkeypatch.setattr(ckpt, "RUN_ID", "resuming")
    said = []
    path = ckpt.resolve_last(str(folder), say=said.append)
    assert ckpt.read_manifest(path)["run"] == "failing"
    assert said and "stopped with NonFiniteLossError" in said[0] and "epoch=1-step=6.ckpt" in said[0], said


# ---------------------------------------------------------------------- nothing foreign runs
class Payload:
    """Unpickling this runs code (a harmless one: it creates a file)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def payload_checkpoint(path, marker: str, folder: bool, sharded: bool = False) -> str:
    """A checkpoint whose pickle would run code; as a folder it carries a valid manifest (an attacker writes
    one too), so only the refusal to unpickle stands between the file and the code."""
    state = {"posttrain": Payload(marker), "state_dict": {}, "global_step": 1, "epoch": 0}
    if not folder:
        with open(path, "wb") as f:
            pickle.dump(state, f)  # a plain pickle: torch.load reads those too
        torch.save(state, path)
        return str(path)
    temp = ckpt.temp_path(str(path), "payload")
    os.makedirs(os.path.join(temp, "transformer", "zero"))
    if sharded:  # the Lightning state is clean; DeepSpeed's own shard file carries the payload
        state = {"posttrain": {}, "state_dict": {}, "global_step": 1, "posttrain_sharded": {"transformer": {}}}
        torch.save({"module": Payload(marker)}, os.path.join(temp, "transformer", "zero", "mp_rank_00_model_states.pt"))
        with open(os.path.join(temp, "transformer", "latest"), "w") as f:
            f.write("zero")
    torch.save(state, os.path.join(temp, "lightning.pt"))
    ckpt.commit(temp, str(path), {})
    return str(path)


def cli_config(tmp_path, **checkpoint_args) -> str:
    with open(os.path.join(ROOT, "configs", "finetune.yaml")) as f:
        config = yaml.safe_load(f)
    config["trainer"].update(max_steps=2, logger=False, enable_progress_bar=False, limit_val_batches=1,
                             default_root_dir=str(tmp_path / "run"), val_check_interval=None)
    config["trainer"]["callbacks"] = [{"class_path": "posttrain.callbacks.checkpoints.ModelCheckpoint",
                                       "init_args": {"dirpath": str(tmp_path / "run" / "ckpt"), **checkpoint_args}}]
    config["model"]["init_args"]["run"] = dict(SIZE)
    config["data"]["init_args"].update(num_samples=4, val_samples=2, batch_size=2)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["file", "folder", "zero-folder"])
@pytest.mark.parametrize("command", ["export", "fit", "validate", "predict"])
def test_payload_checkpoint_never_runs_code(tmp_path, capsys, command, kind):
    from posttrain.lit.tools.cli import main

    marker = str(tmp_path / "pwned")
    path = payload_checkpoint(tmp_path / "evil.ckpt", marker, folder=kind != "file", sharded=kind == "zero-folder")
    if command == "export":
        args = ["export", "--ckpt", path, "--out", str(tmp_path / "out")]
    else:
        args = [command, "--config", cli_config(tmp_path), "--ckpt_path", path]
    unverifiable = pytest.warns(UserWarning, match="a single-file checkpoint without a manifest") \
        if kind == "file" else contextlib.nullcontext()
    with unverifiable, pytest.raises(SystemExit):
        main(args)
    assert not os.path.exists(marker), f"{command} ran code from a {kind} checkpoint"
    message = capsys.readouterr().err
    assert message.startswith(f"posttrain {command}: error:") and "\x1b" not in message, message
    # in the package's words, whoever reads the file (LightningCLI no longer reads a single file itself): refused,
    # why, and never torch's advice to load with weights_only=False
    assert "refused to unpickle" in message and "evil.ckpt" in message and "`io.open`" in message, message
    assert "weights_only" not in message and "Weights only load failed" not in message, message
    assert len(message.splitlines()) <= 3, message


# ---------------------------------------------------------------------- one verified loader
def damage(folder, what: str) -> str:
    """Damage checkpoint ``folder`` in place — its manifest torn (``torn``), its entries without their hashes
    (``manifest``: still JSON), or its state file changed (``file``: bytes flipped, size kept) — and return the
    name the refusal must carry."""
    manifest = folder / ckpt.MANIFEST
    if what == "torn":
        text = manifest.read_text()
        manifest.write_text(text[: len(text) // 2])
    elif what == "manifest":
        entries = json.loads(manifest.read_text())
        for entry in entries["files"].values():
            del entry[entries["hash"]]
        manifest.write_text(json.dumps(entries))
    else:
        flip(str(folder / ckpt.STATE))
        return ckpt.STATE
    return ckpt.MANIFEST


@pytest.mark.slow
@pytest.mark.parametrize("what", ["manifest", "file"])
def test_every_entry_point_refuses_a_damaged_checkpoint_naming_the_file(run, tmp_path, capsys, monkeypatch, what):
    """A damaged manifest (entries without their hashes), or a changed file, in a real checkpoint folder: resume
    (``fit --ckpt_path``), ``validate``, ``predict``, ``export`` and the W&B run-id lookup each stop in one message
    naming the file. (A torn manifest is refused by the same loader, below.)"""
    from posttrain.lit.tools.cli import main

    folder = copy_run(run, tmp_path) / "epoch=1-step=6.ckpt"
    name = damage(folder, what)
    config = cli_config(tmp_path)
    with open(config) as f:
        tracked = yaml.safe_load(f)
    tracked["trainer"]["logger"] = {"class_path": "posttrain.lit.tools.tracking.WandbLogger"}
    (tmp_path / "tracked.yaml").write_text(yaml.safe_dump(tracked))
    commands = {"resume": ["fit", "--config", config, "--ckpt_path", str(folder)],
                "validate": ["validate", "--config", config, "--ckpt_path", str(folder)],
                "predict": ["predict", "--config", config, "--ckpt_path", str(folder)],
                "export": ["export", "--ckpt", str(folder), "--out", str(tmp_path / "out")],
                # the W&B run id is looked up while the config is read, before any trainer or W&B run exists
                "run-id": ["fit", "--config", str(tmp_path / "tracked.yaml"), "--ckpt_path", str(folder)]}
    for entry, args in commands.items():
        with monkeypatch.context() as patch:
            if entry == "run-id":  # refused by the lookup itself: the resume's loader is never reached
                patch.setattr(ckpt, "load", lambda *_, **__: pytest.fail("the run-id lookup read the checkpoint"))
            with pytest.raises(SystemExit):
                main(args)
        message = capsys.readouterr().err
        assert message.startswith(f"posttrain {args[0]}: error: ") and f"{name}:" in message, (entry, message)
        assert len(message.splitlines()) <= 3, (entry, message)
    with pytest.raises(ckpt.CheckpointError, match=name):
        ckpt.wandb_run_id(str(folder))
    assert not (tmp_path / "out").exists()
    if what == "manifest":
        damage(folder, "torn")
        with pytest.raises(ckpt.CheckpointError, match=r"manifest.json: corrupt manifest \("):
            ckpt.load(str(folder))


# ---------------------------------------------------------------------- a real full disk
@pytest.mark.slow
def test_a_write_that_fails_part_way_removes_its_folder_and_names_the_fix(tmp_path):
    """``posttrain fit`` resumed under a file-size limit smaller than a checkpoint: the next checkpoint's write fails
    part-way inside torch's zip writer (EFBIG). The run stops naming the checkpoint, the cause and the fix; its
    temporary folder is gone; the earlier checkpoints and ``last`` are byte-identical.
    (ZeRO, two processes: tests/test_strategy.py.)"""
    from posttrain.lit.tools.cli import main

    config = cli_config(tmp_path, save_last=True)
    main(["fit", "--config", config])  # 2 iterations, one checkpoint (no limit: it is written)
    folder = tmp_path / "run" / "ckpt"
    before, last = files_of(folder), ckpt.last_target(str(folder))
    assert os.path.basename(last) == "epoch=0-step=2.ckpt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = launch.posttrain("fit", "--config", config, "--ckpt_path", "last", "--trainer.max_steps=4",
                            cwd=str(tmp_path), env=env, max_file_bytes=1 << 20)  # 1 MiB; lightning.pt is ~19 MiB
    assert done.returncode == 2 and "posttrain fit: error:" in done.stderr, done.stderr[-3000:]
    message = done.stderr[done.stderr.index("posttrain fit: error:"):]
    assert f"writing checkpoint {str(folder / 'epoch=1-step=4.ckpt')!r} failed (File too large)" in message, message
    assert "the earlier checkpoints are unchanged" in message and "raise that limit" in message, message
    assert "inline_container" not in message and len(message.splitlines()) <= 3, message
    assert not [n for n in os.listdir(folder) if n.startswith(ckpt.TEMP_PREFIX)], os.listdir(folder)
    assert files_of(folder) == before and ckpt.last_target(str(folder)) == last


class FirstOfTwo(ckpt.Processes):
    """Process 0 of two, the other one simulated: it fails nowhere and hashes none of the files (``commit`` then
    hashes what no share did)."""

    rank, size = 0, 2

    def all_gather(self, value):
        return [value, {} if isinstance(value, dict) else None]


def test_the_one_write_sequence_takes_shards_from_every_process(tmp_path):
    """``write_checkpoint`` with ``Shards``: the shard folders are made before any process writes, every process's
    shards land in the temporary folder before ``lightning.pt``, process 0 adds the JSON files, and the folder
    verifies and loads. A shard write that fails removes the temporary folder and names the destination, the process
    and the fix; the earlier checkpoint stays as it was."""
    seen = []

    def write(temp):
        seen.append(ckpt.files_under(temp) + sorted(os.listdir(temp)))
        torch.save({"shard": torch.arange(3)}, os.path.join(temp, "transformer", "zero", "shard_0.pt"))

    destination = str(tmp_path / "a.ckpt")
    shards = ckpt.Shards(FirstOfTwo(), write, folders=("transformer/zero",), files={"sharded.json": {"x": 1}})
    ckpt.write_checkpoint({"global_step": 2, "state_dict": {}}, destination, meta={"world_size": 2}, shards=shards)
    assert seen == [["transformer"]]  # no file yet, the shard folder made
    manifest = ckpt.verify(destination)
    assert sorted(manifest["files"]) == [ckpt.STATE, "sharded.json", "transformer/zero/shard_0.pt"]
    assert manifest["world_size"] == 2 and manifest["global_step"] == 2
    with open(os.path.join(destination, "sharded.json")) as f:
        assert json.load(f) == {"x": 1}
    assert ckpt.load(destination, gather=False)["global_step"] == 2
    before = files_of(tmp_path)

    def fails(temp):
        raise OSError(28, "No space left on device")

    broken = ckpt.Shards(FirstOfTwo(), fails, folders=("transformer/zero",))
    with pytest.raises(ckpt.CheckpointError, match=r"writing checkpoint '.*b\.ckpt' failed on process 0 \(No space "
                                                   r"left on device\); the earlier checkpoints are unchanged"):
        ckpt.write_checkpoint({"global_step": 4}, str(tmp_path / "b.ckpt"), shards=broken)
    assert files_of(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["a.ckpt"]


def files_of(folder) -> dict[str, dict]:
    """Size and hash of every checkpoint file under ``folder`` (the failure note a failed run leaves aside)."""
    return {rel: ckpt.hash_file(os.path.join(folder, rel)) for rel in ckpt.files_under(str(folder))
            if rel != ckpt.FAILED}


def test_deepspeed_shard_loader_runs_under_the_allow_list(tmp_path):
    """DeepSpeed's own loader (weights_only=False inside) refuses a payload under restricted_unpickling and
    still reads its real optimizer shard types."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    marker = tmp_path / "pwned"
    torch.save({"x": Payload(str(marker))}, tmp_path / "evil.pt")
    torch.save({"scaler": LossScaler(1.0), "stage": ZeroStageEnum.gradients}, tmp_path / "good.pt")
    engine = TorchCheckpointEngine()
    with pytest.raises(ckpt.CheckpointError, match=r"shards: refused to unpickle"):
        with ckpt.restricted_unpickling("shards"):
            engine.load(str(tmp_path / "evil.pt"))
    with ckpt.restricted_unpickling("shards"):
        good = engine.load(str(tmp_path / "good.pt"))
    assert not marker.exists()
    assert good["scaler"].cur_scale == 1.0 and good["stage"] == ZeroStageEnum.gradients
    assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") is None  # restored afterwards


def test_export_refuses_a_non_empty_folder(run, tmp_path, capsys):
    from posttrain.lit.tools.cli import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    last = str(run[0] / "last.ckpt")
    with pytest.raises(SystemExit):
        main(["export", "--ckpt", last, "--out", str(out)])
    assert "is not empty; choose a new folder or pass --overwrite true" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine" and os.listdir(out) == ["keep.txt"]
    main(["export", "--ckpt", last, "--out", str(out), "--overwrite", "true"])
    assert (out / "model_index.json").exists() and (out / "transformer" / "config.json").exists()


# ---------------------------------------------------------------------- data position
def batches(loader, n=None):
    out = []
    for batch in loader:
        out.append(batch.tolist())
        if n is not None and len(out) == n:
            break
    return out


@pytest.mark.parametrize("stop", [1, 2, 3])
def test_loader_resumes_at_any_batch_and_never_draws_global_rng(stop):
    """3 batches an epoch: stopping after 1, 2 or 3 (the epoch's last) continues exactly where the
    uninterrupted order goes, and iterating leaves the global torch RNG untouched."""
    data = list(range(6))

    def loader():
        return ResumableLoader(data, batch_size=2, sampler=ResumableSampler(data, seed=3), seed=3)

    straight = loader()
    rng = torch.get_rng_state()
    order = []
    for epoch in range(2):
        straight.sampler.set_epoch(epoch)
        order += batches(straight)
    assert torch.equal(torch.get_rng_state(), rng)

    first = loader()
    first.sampler.set_epoch(0)
    seen = batches(first, stop)
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    epoch = resumed.sampler.epoch
    seen += batches(resumed)
    if epoch == 0:
        resumed.sampler.set_epoch(1)
        seen += batches(resumed)
    assert seen == order, (stop, state)
    assert epoch == (1 if stop == 3 else 0)


@pytest.mark.parametrize("replicas, stop, again", [(1, 3, 0), (4, 2, 0), (4, 1, 4)])
def test_loader_resumed_at_another_world_size_continues_after_the_same_samples(replicas, stop, again, caplog):
    """A position written by 2 processes (batch 2, 16 samples) and resumed by ``replicas``: over all processes the
    epoch draws every sample once — the ones drawn before the checkpoint and the rest after — when the count
    divides at the new size (2 -> 1 always); else the few before the last batch boundary are drawn again, and the
    one line about it says how many."""
    import collections
    import logging

    data = list(range(16))

    def loaders(world):
        return [ResumableLoader(data, batch_size=2, sampler=ResumableSampler(data, seed=3, num_replicas=world, rank=r),
                                seed=3) for r in range(world)]

    written = loaders(2)
    before = [i for loader in written for batch in batches(loader, stop) for i in batch]
    states = [loader.state_dict() for loader in written]
    assert states[0] == states[1]
    resumed = loaders(replicas)
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for loader in resumed:
            loader.load_state_dict(states[0])
    after = [i for loader in resumed for batch in batches(loader) for i in batch]
    counts = collections.Counter(before + after)
    assert set(counts) == set(data) and sum(n - 1 for n in counts.values()) == again, counts
    said = [r.getMessage() for r in caplog.records if "the checkpoint stopped after" in r.getMessage()] + \
        [str(w.message) for w in warned if "the checkpoint stopped after" in str(w.message)]
    assert len(said) == replicas, said  # one line per process here; rank_zero_* says it once in a run
    assert (f"{again} of them are drawn again" if again else "after exactly those samples") in said[0], said[0]


@pytest.mark.slow
def test_secrets_in_the_environment_are_written_nowhere(tmp_path):
    """A real `posttrain fit` (W&B offline, checkpoints, samples) with fake secrets in its environment: none of
    them appears in any file it wrote, nor in its output."""
    secrets = {"WANDB_API_KEY": "fakewandbkey0123456789abcdef0123456789abcd", "HF_TOKEN": "hf_fakeTOKENxyz123",
               "HUGGING_FACE_HUB_TOKEN": "hf_fakeHUBtoken456", "AWS_SECRET_ACCESS_KEY": "fakeAWSsecret789/xyz",
               "OPENAI_API_KEY": "sk-fakeOPENAIkey000"}
    with open(os.path.join(ROOT, "configs", "finetune.yaml")) as f:
        config = yaml.safe_load(f)
    run = tmp_path / "run"
    config["trainer"].update(max_steps=2, enable_progress_bar=False, limit_val_batches=1, val_check_interval=2,
                             default_root_dir=str(run))
    callbacks = {c["class_path"].rpartition(".")[2]: c for c in config["trainer"]["callbacks"]}
    callbacks["ModelCheckpoint"]["init_args"].update(dirpath=str(run / "ckpt"), every_n_train_steps=2)
    callbacks["SampleVideos"]["init_args"].update(every_n_iterations=2)
    config["model"]["init_args"]["run"] = dict(SIZE)
    config["data"]["init_args"].update(num_samples=4, val_samples=2, batch_size=2)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), "WANDB_MODE": "offline",
           **secrets}
    done = launch.posttrain("fit", "--config", str(tmp_path / "config.yaml"), cwd=str(tmp_path), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    files = [os.path.join(d, n) for d, _, names in os.walk(tmp_path) for n in names]
    assert any("wandb" in f for f in files) and any(f.endswith("lightning.pt") for f in files)
    assert any(f.endswith(".gif") for f in files)
    for name, value in secrets.items():
        assert value not in done.stdout + done.stderr, f"{name} printed"
        for file in files:
            with open(file, "rb") as f:
                assert value.encode() not in f.read(), f"{name} written to {file}"


def test_the_payload_is_live(tmp_path):
    """The payload checkpoints above do run code when unpickled without the allow-list."""
    for kind in ("file", "folder"):
        marker = tmp_path / f"pwned-{kind}"
        path = payload_checkpoint(tmp_path / f"evil-{kind}.ckpt", str(marker), folder=kind == "folder")
        torch.load(path if kind == "file" else os.path.join(path, "lightning.pt"), weights_only=False)
        assert marker.exists()
