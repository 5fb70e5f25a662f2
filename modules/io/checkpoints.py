"""Checkpoints that survive any kill, refuse corruption and never run code.

Every checkpoint is a folder ``<name>.ckpt/``, whatever the strategy::

    lightning.pt       the Lightning state (weights, optimizers, loops, RNGs, versions, data position); without what
                       a source rebuilds (frozen experts read from files, LoRA bases: ``lit/engine/resume.py``)
    sharded.json       (ShardedExpertsStrategy) ZeRO stage and world size of each sharded expert
    <expert>/zero/...  (ShardedExpertsStrategy) one ``engine.save_checkpoint`` folder per sharded expert (a LoRA
                       expert's without its base)
    adapter/           (a LoRA run, ``callbacks/checkpoints.py``) the served LoRA adapter alone (``modules/io/lora.py``)
    manifest.json      size and SHA-256 of every other file; written last, it marks the folder complete

Writing one checkpoint (the commit-marker protocol of Orbax and torch.distributed.checkpoint):

1. every file goes into a fresh temporary folder ``.tmp-<token>-<name>.ckpt`` beside the destination (same
   filesystem, so the final rename is atomic); ``lightning.pt`` is hashed while it is written, the ZeRO shards
   are hashed by every process for its share once all are written; every file is flushed and fsynced;
2. ``manifest.json`` is written and fsynced, then the temporary folder;
3. ``rename(temp, destination)`` and an fsync of the parent folder: the checkpoint appears whole or not at all;
4. ``last.ckpt`` is a relative symlink, switched to the new folder by ``rename`` of a fresh symlink over it.

A kill at any instant therefore leaves ``last.ckpt`` on the previous complete checkpoint or on the new one.
Leftover temporary folders are never read and are removed at the next save.

Reading: ``load`` is the one loader every entry point uses (resume, ``validate``, ``predict``, ``export``; the W&B
run lookup reads the verified manifest). ``verify`` checks the manifest (every file present, same size and hash, no unexpected file) before
anything is unpickled, and names the first file that differs; ``resolve_last`` falls back to the newest
checkpoint that verifies, saying so. Nothing is unpickled beyond an allow-list: ``lightning.pt`` loads with
``weights_only=True``, and DeepSpeed's own shard loaders run under ``restricted_unpickling`` (which forces
``weights_only=True`` on every ``torch.load`` DeepSpeed makes, with its three checkpoint types allowed).

``write_checkpoint`` is the one write sequence, for one process or for the processes of a sharded strategy (which
hand it their shards: ``Shards``). This is the on-disk protocol only, without Lightning: ``lit/engine/checkpoint_io.py``
plugs it into Lightning's checkpoint I/O, ``lit/engine/strategy.py`` writes the sharded folders through it,
``callbacks/checkpoints.py`` keeps ``last`` by it.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pickle
import re
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

FORMAT = "posttrain-checkpoint/1"
MANIFEST = "manifest.json"
STATE = "lightning.pt"
SHARDED_META = "sharded.json"  # (ShardedExpertsStrategy) ZeRO stage and world size of each sharded expert
ZERO_TAG = "zero"  # the ``engine.save_checkpoint`` tag inside each sharded expert's folder
LAST = "last.ckpt"
HIDDEN = ".last"  # entries only ``last.ckpt`` points to (no top-k checkpoint was written at that step)
FAILED = "last.ckpt.failed.json"  # written when a fit run ends with an error
TEMP_PREFIX, OLD_PREFIX = ".tmp-", ".old-"
HASH = "sha256"
CHUNK = 8 << 20
# what a user adds to a checkpoint after it was written, by a documented command (so not in the manifest):
# ``python -m deepspeed.checkpoint.ds_to_universal --output_folder <ckpt>/<expert>/zero_universal`` writes that
# folder and ``<expert>/latest_universal``
ADDED_LATER_FOLDERS, ADDED_LATER_FILES = ("zero_universal",), ("latest_universal",)
META_OPTION = "posttrain_meta"  # Lightning ``storage_options`` key: extra manifest fields from the checkpoint callback
EXTRA_OPTION = "posttrain_extra"  # ``storage_options`` key: a writer of further files (``write_checkpoint``'s ``extra``)
RUN_ID = uuid.uuid4().hex[:12]  # this process's fit attempt; every manifest it writes carries it


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupt, or not a posttrain checkpoint. The message names the file."""


def fault_point(name: str) -> None:
    """A named instant of the write and load protocols. Does nothing; the kill tests wrap it."""


# ---------------------------------------------------------------------- no foreign code
def allowed_globals() -> list:
    """The only non-builtin types ``torch.load`` may build from DeepSpeed's shards: its optimizer shards hold these
    three, plain data objects without code. ``lightning.pt`` needs none (tensors, dicts, lists, tuples, numbers,
    strings; numpy's RNG state is stored as a tensor), so reading it never imports DeepSpeed."""
    allowed: list = []
    with contextlib.suppress(ImportError):
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        allowed += [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]
    return allowed


@contextlib.contextmanager
def restricted_unpickling(where: str = "", deepspeed: bool = True) -> Iterator[None]:
    """Every ``torch.load`` inside runs weights-only with the allow-list (``deepspeed``: DeepSpeed's three shard
    types too) — also DeepSpeed's shard loader, which asks for full unpickling: ``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1``
    makes torch ignore that request, so nothing in a checkpoint can run code (tests/test_checkpoints.py loads a
    live payload through it). A refused file becomes a ``CheckpointError`` naming ``where``."""
    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(allowed_globals() if deepspeed else []):
            yield
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{where or 'checkpoint'}: refused to unpickle a file there: it holds "
                              f"{_refused_object(err)}, outside the allow-list of checkpoint types (tensors, numbers, "
                              f"strings, containers). posttrain never runs code from a checkpoint; load only "
                              f"checkpoints written by `posttrain fit`") from None
    finally:
        if previous is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous


def _refused_object(err: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler refused, from its long generic text (which suggests turning
    weights-only loading off: never here)."""
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err)) \
        or re.search(r"Unsupported operand (\S+)", str(err))
    return f"`{found.group(1)}`" if found else "an object torch's weights-only unpickler does not build"


def load_state(file: str, deepspeed: bool = False) -> dict[str, Any]:
    """``torch.load`` of one state file, weights only: ``lightning.pt`` needs no type beyond torch's own (``deepspeed``:
    a ZeRO shard file, with DeepSpeed's three)."""
    try:
        with restricted_unpickling(file, deepspeed=deepspeed):
            return torch.load(file, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{file}: not a readable checkpoint ({type(err).__name__}: {reason})") from None


# ---------------------------------------------------------------------- writing
class _HashingWriter:
    """A binary file that hashes and counts what passes through it (``torch.save`` writes sequentially)."""

    def __init__(self, f):
        self.f, self.hash, self.size = f, hashlib.new(HASH), 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.hash.update(view)
        self.size += view.nbytes
        fault_point("write:bytes")
        return self.f.write(view)

    def flush(self) -> None:
        self.f.flush()

    def digest(self) -> dict[str, Any]:
        return {"size": self.size, HASH: self.hash.hexdigest()}


def save_state(checkpoint: dict[str, Any], file: str) -> dict[str, Any]:
    """``torch.save`` into ``file``, hashed on the way, flushed and fsynced; returns its manifest entry."""
    with open(file, "wb") as f:
        writer = _HashingWriter(f)
        torch.save(checkpoint, writer)
        f.flush()
        os.fsync(f.fileno())
    return writer.digest()


def hash_file(path: str, sync: bool = False) -> dict[str, Any]:
    """Size and hash of a file (and an fsync of it when ``sync``: for files other code wrote)."""
    h, size = hashlib.new(HASH), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
        if sync:
            os.fsync(f.fileno())
    return {"size": size, HASH: h.hexdigest()}


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def files_under(root: str) -> list[str]:
    """Every file under ``root``, as sorted ``/``-separated relative paths."""
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            found.append(os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/"))
    return sorted(found)


def new_token() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


def temp_path(destination: str, token: str) -> str:
    """The temporary name of ``destination`` while it is written: same folder, hidden, unique."""
    parent, name = os.path.split(os.path.abspath(destination))
    return os.path.join(parent, f"{TEMP_PREFIX}{token}-{name}")


def commit(temp: str, destination: str, hashed: dict[str, dict], meta: Optional[dict] = None) -> None:
    """Finish ``temp`` (hash and fsync what ``hashed`` lacks, write the manifest) and rename it to
    ``destination``. One process calls this, after every process wrote its files."""
    files = dict(hashed)
    for rel in files_under(temp):
        if rel not in files:
            files[rel] = hash_file(os.path.join(temp, *rel.split("/")), sync=True)
    manifest = {"format": FORMAT, "hash": HASH, "written_at": time.time(), "run": RUN_ID, **(meta or {}),
                "files": files}
    with open(os.path.join(temp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    for folder, _, _ in sorted(os.walk(temp), key=lambda entry: -len(entry[0])):  # deepest first
        fsync_dir(folder)
    fault_point("write:manifest")
    parent = os.path.dirname(os.path.abspath(destination))
    if os.path.lexists(destination):
        # a name written before (a rerun): set the old one aside until the new one is in place
        old = os.path.join(parent, f"{OLD_PREFIX}{new_token()}-{os.path.basename(destination)}")
        os.rename(destination, old)
        os.rename(temp, destination)
        fsync_dir(parent)
        remove_entry(old)
    else:
        os.rename(temp, destination)
        fsync_dir(parent)
    fault_point("write:committed")


class Processes:
    """The processes that write one checkpoint together and the collectives the write needs: one process by default
    (none needed); a sharded strategy gives its own (``lit/engine/strategy.py``)."""

    rank: int = 0
    size: int = 1

    def broadcast(self, value: Any) -> Any:
        """Process 0's ``value``, on every process."""
        return value

    def barrier(self) -> None:
        pass

    def all_gather(self, value: Any) -> list:
        """Every process's ``value``, in rank order, on every process."""
        return [value]


@dataclass
class Shards:
    """What the processes of a sharded strategy add to one checkpoint before its Lightning state (``write_checkpoint``).

    Args:
        processes: the processes that write together (every one of them calls ``write_checkpoint``).
        write: called on every process with the temporary folder, to write its shard files there (one
            ``engine.save_checkpoint`` folder per sharded expert).
        folders: folders process 0 makes in the temporary folder before any process writes.
        files: small files process 0 writes as JSON beside ``lightning.pt`` (``sharded.json``), by relative path.
    """

    processes: Processes
    write: Callable[[str], None]
    folders: tuple[str, ...] = ()
    files: dict[str, Any] = field(default_factory=dict)


def write_checkpoint(checkpoint: dict[str, Any], destination: str, meta: Optional[dict] = None,
                     shards: Optional[Shards] = None, extra: Optional[Callable[[str], Any]] = None) -> None:
    """Write ``checkpoint`` as a complete checkpoint folder at ``destination``: the one write sequence (steps 1-3 of
    the protocol above). Alone by default; with ``shards``, every process of ``shards.processes`` calls this with the
    same destination: each writes its shards into the temporary folder, process 0 writes ``lightning.pt``, each
    hashes and fsyncs a share of the files, and process 0 writes the manifest and renames the folder once all have.

    A failed write (a full disk, a file-size limit, anything, on any process) removes its temporary folder, leaves
    every earlier checkpoint as it was and raises ``CheckpointError`` on every process, naming the destination, the
    cause (and the process that failed) and the fix. ``meta``: extra manifest fields. ``extra``: called by process 0
    with the temporary folder after ``lightning.pt``, to write further files there (a LoRA run's ``adapter/``); they
    are hashed into the manifest like every other file."""
    processes = shards.processes if shards is not None else Processes()
    lead = processes.rank == 0
    temp = temp_path(destination, processes.broadcast(new_token() if lead else None))
    try:
        # 1. the temporary folder beside the destination (and every folder the shards go into)
        with _agreed(processes, temp, destination):
            if lead:
                os.makedirs(temp)
                for folder in shards.folders if shards is not None else ():
                    os.makedirs(os.path.join(temp, folder))
        processes.barrier()
        fault_point("write:start")
        hashed: dict[str, dict] = {}
        # 2. every process's shards, then the Lightning state (hashed while it is written)
        if shards is not None:
            with _agreed(processes, temp, destination):
                shards.write(temp)
            fault_point("write:shards")
        with _agreed(processes, temp, destination):
            if lead:
                hashed[STATE] = save_state(checkpoint, os.path.join(temp, STATE))
                if extra is not None:
                    extra(temp)
                for rel, value in (shards.files if shards is not None else {}).items():
                    with open(os.path.join(temp, rel), "w") as f:
                        json.dump(value, f, indent=1)
        fault_point("write:state")
        # 3. every process hashes and fsyncs a share of the other files (the shards are most of the bytes)
        if shards is not None:
            mine: dict[str, dict] = {}
            with _agreed(processes, temp, destination):
                files = [rel for rel in files_under(temp) if rel != STATE]
                mine = {rel: hash_file(os.path.join(temp, rel), sync=True)
                        for rel in files[processes.rank::processes.size]}
            for share in processes.all_gather(mine):
                hashed.update(share)
        # 4. the manifest, then the rename
        with _agreed(processes, temp, destination):
            if lead:
                commit(temp, destination, hashed, meta=_meta_of(checkpoint, meta))
    except BaseException as err:
        if not isinstance(err, Exception) and processes.size == 1:  # an interrupt: the write was stopped, not failed
            shutil.rmtree(temp, ignore_errors=True)
        raise


@contextlib.contextmanager
def _agreed(processes: Processes, temp: str, destination: str) -> Iterator[None]:
    """One phase of a write, then agreement: if any process failed (a full disk, a file-size limit, anything — torch's
    zip writer raises RuntimeError, DeepSpeed its own), all of them stop with the same message, naming the process and
    the cause, and process 0 removes the temporary folder (earlier checkpoints and ``last`` stay)."""
    failure: Optional[tuple[str, str]] = None  # (cause, fix), told by the process that failed
    error: Optional[Exception] = None
    try:
        yield
    except Exception as err:
        failure, error = failure_of(err, destination), err
    failed = [(rank, told) for rank, told in enumerate(processes.all_gather(failure)) if told is not None]
    if not failed:
        return
    if processes.rank == 0:
        shutil.rmtree(temp, ignore_errors=True)
    rank, (reason, fix) = failed[0]
    where = f" on process {rank}" if processes.size > 1 else ""
    raise CheckpointError(write_failed(destination, reason, fix, where)) from error


def failure_of(err: BaseException, destination: str) -> tuple[str, str]:
    """(cause, fix) of a failed write, told on the process where it failed.

    The cause is the operating system's error where Python saw one: torch's zip writer over a Python file turns
    a failed ``write`` into ``RuntimeError: [enforce fail at inline_container.cc:…] . unexpected pos …`` with the
    ``OSError`` (``File too large``, ``No space left on device``) as its context. Its C++ file writer (DeepSpeed's
    shards) raises the same text with no error behind it: a file stopped part-way, because the disk is full or a
    file-size limit was reached — the process's limit tells which."""
    limit = _file_size_limit()
    cause: Optional[BaseException] = err
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if cause is not None:
        reason, code = cause.strerror or str(cause), cause.errno
    else:
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        short = re.search(r"unexpected pos \d+ vs \d+", text)
        reason = (f"a file write stopped part-way (torch: {short.group(0)})" if short
                  else f"{type(err).__name__}: {text}" if text else type(err).__name__)
        code = errno.EFBIG if short and limit is not None else None
    if code == errno.EFBIG and limit is not None:
        fix = (f"This process may write files of at most {limit} bytes (a file-size limit, `ulimit -f`) and the "
               f"checkpoint's are larger: raise that limit, or point ModelCheckpoint's dirpath elsewhere")
    elif code == errno.EFBIG:
        fix = "The checkpoint is larger than the filesystem's largest file: point ModelCheckpoint's dirpath elsewhere"
    else:
        folder = os.path.dirname(os.path.abspath(destination))
        fix = f"Free space in {folder!r} (or point ModelCheckpoint's dirpath elsewhere)"
    return reason, fix


def _file_size_limit() -> Optional[int]:
    """The largest file this process may write (``RLIMIT_FSIZE``), or None without a limit."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def write_failed(destination: str, reason: str, fix: str, where: str = "") -> str:
    """The message of a failed checkpoint write: the destination, the cause (``where``: on which process) and the
    fix (``failure_of``)."""
    return (f"writing checkpoint {destination!r} failed{where} ({reason}); the earlier checkpoints are unchanged (its "
            f"temporary folder is removed). {fix}, and resume with --ckpt_path last")


def _meta_of(checkpoint: dict, meta: Optional[dict]) -> dict:
    return {"global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch"), **(meta or {})}


def remove_entry(path: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


# ---------------------------------------------------------------------- reading
_verified: dict[str, tuple] = {}  # realpath -> stat fingerprint of a folder that verified in this process


def _fingerprint(folder: str, rels: list[str]) -> tuple:
    stats = []
    for rel in [MANIFEST, *rels]:
        st = os.stat(os.path.join(folder, *rel.split("/")))
        stats.append((rel, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(stats)


def read_manifest(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        raise CheckpointError(f"{folder}: no {MANIFEST}: an incomplete checkpoint (killed while written?) or not "
                              f"one posttrain wrote; resume another checkpoint of this run (`--ckpt_path last` "
                              f"picks the newest complete one)")
    try:
        with open(path) as f:
            manifest = json.load(f)
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
                or not isinstance(manifest.get("files"), dict):
            raise ValueError(f"format {manifest.get('format') if isinstance(manifest, dict) else manifest!r}")
        algorithm = manifest.get("hash", HASH)
        if not all(isinstance(entry, dict) and isinstance(entry.get("size"), int)
                   and isinstance(entry.get(algorithm), str) for entry in manifest["files"].values()):
            raise ValueError("an entry without size and hash")
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: corrupt manifest ({err}); the checkpoint cannot be verified") from None
    return manifest


def verify(path: str) -> dict[str, Any]:
    """Check checkpoint folder ``path`` against its manifest before anything is loaded; returns the manifest.

    Raises ``CheckpointError`` naming the first missing, truncated, changed or unexpected file.
    """
    folder = os.path.realpath(path)
    if not os.path.isdir(folder):
        raise CheckpointError(f"{path}: not a checkpoint folder")
    manifest = read_manifest(folder)
    files: dict[str, dict] = manifest["files"]
    algorithm = manifest.get("hash", HASH)
    if algorithm not in hashlib.algorithms_available:
        raise CheckpointError(f"{path}/{MANIFEST}: unknown hash {algorithm!r}")
    extra = [rel for rel in files_under(folder) if rel != MANIFEST and rel not in files and not _added_later(rel)]
    if extra:
        raise CheckpointError(f"{os.path.join(path, extra[0])}: not in the checkpoint's manifest ({len(extra)} such "
                              f"file(s)); it was added after the checkpoint was written. Remove it, or resume "
                              f"another checkpoint")
    for rel, expected in files.items():
        file = os.path.join(folder, *rel.split("/"))
        if not os.path.isfile(file):
            raise CheckpointError(f"{os.path.join(path, rel)}: missing (the manifest lists it)")
    try:
        fingerprint = _fingerprint(folder, list(files))
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read ({err})") from None
    if _verified.get(folder) == fingerprint:
        return manifest
    for rel, expected in files.items():
        file = os.path.join(folder, *rel.split("/"))
        size = os.path.getsize(file)
        if size != expected["size"]:
            raise CheckpointError(f"{os.path.join(path, rel)}: {size} bytes, the manifest says {expected['size']} "
                                  f"(truncated or overwritten); this checkpoint is damaged")
        h = hashlib.new(algorithm)
        with open(file, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
        if h.hexdigest() != expected[algorithm]:
            raise CheckpointError(f"{os.path.join(path, rel)}: content differs from the manifest ({algorithm} "
                                  f"mismatch: corrupted on disk or changed after writing); this checkpoint is "
                                  f"damaged")
    _verified[folder] = fingerprint
    return manifest


def _added_later(rel: str) -> bool:
    *folders, name = rel.split("/")
    return name in ADDED_LATER_FILES or any(part in ADDED_LATER_FOLDERS for part in folders)


def load(path: str, gather: bool = True) -> dict[str, Any]:
    """The one verified loader: the Lightning state of checkpoint ``path``, weights only — resume, ``validate``,
    ``predict``, ``export`` and the W&B run lookup all read checkpoints through here.

    A folder is verified against its manifest (every file, ZeRO shards too) before anything is unpickled; with
    ``gather`` every sharded expert's ZeRO shards are rebuilt into full fp32 weights in ``state_dict`` (a resume
    under ``ShardedExpertsStrategy`` passes ``gather=False``: its engines read their own shards). A single file
    (written by Lightning itself or an older posttrain) has no manifest: it loads weights-only, with a warning.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist; give a checkpoint folder written by `posttrain "
                                f"fit` (e.g. <run>/checkpoints/last.ckpt; `fit`/`validate`/`predict` also take "
                                f"`--ckpt_path last`, the newest of the config's run)")
    if not os.path.isdir(path):
        warnings.warn(f"{path}: a single-file checkpoint without a manifest: its integrity cannot be checked "
                      f"(posttrain writes checkpoint folders with a manifest); loading it weights-only", stacklevel=2)
        return load_state(path)
    verify(path)
    fault_point("load:verified")
    state = load_state(os.path.join(path, STATE))
    if gather and state.get("posttrain_sharded"):
        gather_sharded(path, state)
    return state


def gather_sharded(folder: str, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Add to ``checkpoint["state_dict"]`` ``card.models.<expert>.<param>`` of every sharded expert, rebuilt from
    its ZeRO shards (``full_weights``). ``folder`` has been verified by ``load``."""
    for name in checkpoint.get("posttrain_sharded", {}):
        for key, value in full_weights(os.path.join(folder, name)).items():
            checkpoint["state_dict"][f"card.models.{name}.{key}"] = value
    return checkpoint


def full_weights(expert_dir: str) -> dict[str, torch.Tensor]:
    """One sharded expert's full fp32 weights, rebuilt from its ZeRO shard folder ``expert_dir`` (verified by the
    caller) by ``deepspeed.utils.zero_to_fp32``, under ``restricted_unpickling``; without the frozen weights a
    checkpoint saved with ``exclude_frozen_parameters`` leaves out (a LoRA base: its source rebuilds it).

    Plain tensors: ``zero_to_fp32`` slices the weights out of the optimizer's flat fp32 partitions, which it loads as
    they were saved (requiring grad), so each came back as a view with autograd history (``ViewBackward0``) that
    ``copy.deepcopy`` refuses; they are detached here. Under ZeRO-2 they stay views of one flat buffer per parameter
    group (no copy: a clone would hold the expert's fp32 weights twice at the peak); ``torch.save`` of a view writes
    its whole buffer, so a caller that keeps or saves a few of them alone clones those."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag = ZERO_TAG if os.path.isdir(os.path.join(expert_dir, ZERO_TAG)) else None
    with restricted_unpickling(expert_dir):
        weights = get_fp32_state_dict_from_zero_checkpoint(expert_dir, tag=tag)
    return {key: value.detach() for key, value in weights.items()}


def to_universal(shards: str, out: str, stage: int) -> None:
    """Convert one expert's ZeRO shard folder ``shards`` (verified by ``load``) into DeepSpeed's universal checkpoint
    folder ``out`` (and ``<parent of out>/latest_universal``), which DeepSpeed loads at any world size: its own
    ``ds_to_universal`` run in this process (one worker: no process pool), under ``restricted_unpickling``, with its
    progress output kept back (its last lines are in the error when it fails). ZeRO-2 shards lack the optimizer
    state the universal format wants: ``inject_missing_state`` adds it, as DeepSpeed documents."""
    import argparse
    import io

    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=shards, output_folder=out, num_extract_workers=1, num_merge_workers=1,
                              keep_temp_folder=False, strict=True, inject_missing_state=stage <= 2)
    said = io.StringIO()
    try:
        with restricted_unpickling(shards), contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            ds_to_universal.main(args)
    except CheckpointError:
        raise
    except Exception as err:
        tail = " | ".join(said.getvalue().strip().splitlines()[-3:])
        raise CheckpointError(f"{shards}: DeepSpeed's ds_to_universal failed ({type(err).__name__}: {err}; it said: "
                              f"{tail or 'nothing'})") from err


# ---------------------------------------------------------------------- last
def link_last(dirpath: str, target: str) -> None:
    """Point ``dirpath/last.ckpt`` at ``target`` atomically (a relative symlink renamed over the old one)."""
    last = os.path.join(dirpath, LAST)
    if os.path.isdir(last) and not os.path.islink(last):
        # a real folder written before links existed: keep it under another name
        os.rename(last, os.path.join(dirpath, f"last-{time.strftime('%Y%m%d-%H%M%S')}.ckpt"))
    elif os.path.isfile(last) and not os.path.islink(last):
        os.rename(last, os.path.join(dirpath, f"last-{time.strftime('%Y%m%d-%H%M%S')}.ckpt"))
    link = os.path.join(dirpath, f"{TEMP_PREFIX}{new_token()}-{LAST}")
    os.symlink(os.path.relpath(os.path.abspath(target), os.path.abspath(dirpath)), link)
    os.replace(link, last)
    fsync_dir(dirpath)
    fault_point("write:linked")


def last_target(dirpath: str) -> Optional[str]:
    """What ``last.ckpt`` points to (a path), or None."""
    last = os.path.join(dirpath, LAST)
    if os.path.islink(last):
        return os.path.normpath(os.path.join(dirpath, os.readlink(last)))
    return last if os.path.exists(last) else None


def entries(dirpath: str) -> list[str]:
    """Committed checkpoint folders under ``dirpath`` (named, hidden ``.last/`` ones, and ones set aside by an
    interrupted replace), newest first by their manifest's time."""
    found = []
    for folder in (dirpath, os.path.join(dirpath, HIDDEN)):
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if name.startswith(TEMP_PREFIX) or os.path.islink(path) or not os.path.isdir(path):
                continue
            try:
                manifest = read_manifest(path)
            except CheckpointError:
                continue
            found.append((manifest.get("written_at", 0.0), manifest.get("global_step") or 0, path))
    return [path for *_, path in sorted(found, reverse=True)]


def resolve_last(dirpath: str, say: Callable[[str], None]) -> Optional[str]:
    """The checkpoint ``--ckpt_path last`` resumes: what ``last.ckpt`` points to if it verifies, else the newest
    checkpoint under ``dirpath`` that does (``say`` tells why). None when there is none."""
    target = last_target(dirpath)
    problem = None
    if target is not None and os.path.isfile(target):
        say(f"{target} is a single-file checkpoint without a manifest (written by Lightning itself or an older "
            f"posttrain): resuming it unverified, weights only")
        return target
    if target is not None:
        try:
            manifest = verify(target)
            _say_if_failed(dirpath, target, manifest, say)
            return target
        except CheckpointError as err:
            problem = f"{os.path.join(dirpath, LAST)} -> {target} is refused: {err}"
    for path in entries(dirpath):
        if target is not None and os.path.realpath(path) == os.path.realpath(target):
            continue
        try:
            manifest = verify(path)
        except CheckpointError as err:
            say(f"skipping {path}: {err}")
            continue
        if problem:
            say(f"{problem}. Resuming the newest checkpoint that verifies instead: {path} "
                f"(iteration {manifest.get('global_step')}).")
        elif target is None:
            say(f"{os.path.join(dirpath, LAST)} is missing (a kill before the first link?); resuming the newest "
                f"complete checkpoint {path} (iteration {manifest.get('global_step')}).")
        _say_if_failed(dirpath, path, manifest, say)
        return path
    if problem:
        raise CheckpointError(f"{problem}; no other checkpoint under {dirpath} verifies. Start a new run (drop "
                              f"--ckpt_path) or restore the checkpoint from a copy")
    return None


def note_failure(dirpath: str, error: BaseException, step: int) -> None:
    """Record that this run failed, so that a later ``--ckpt_path last`` says so before resuming its checkpoint."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    note = {"run": RUN_ID, "error": f"{type(error).__name__}: {first_line}", "iteration": step, "time": time.time()}
    os.makedirs(dirpath, exist_ok=True)
    temp = os.path.join(dirpath, f"{TEMP_PREFIX}{new_token()}-{FAILED}")
    with open(temp, "w") as f:
        json.dump(note, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, os.path.join(dirpath, FAILED))
    fsync_dir(dirpath)


def _say_if_failed(dirpath: str, path: str, manifest: dict, say: Callable[[str], None]) -> None:
    note_file = os.path.join(dirpath, FAILED)
    if not os.path.isfile(note_file):
        return
    try:
        with open(note_file) as f:
            note = json.load(f)
    except (OSError, ValueError):
        return
    if note.get("run") != manifest.get("run"):
        return
    healthy = None
    for other in entries(dirpath):
        with contextlib.suppress(CheckpointError):
            if read_manifest(other).get("run") != note["run"]:
                healthy = other
                break
    hint = (f" The newest checkpoint of an earlier run that did not fail is {healthy}: pass `--ckpt_path {healthy}` "
            f"to resume that instead." if healthy else "")
    say(f"resuming {path}, written by a run that then stopped with {note['error']} at iteration "
        f"{note['iteration']}; it may fail the same way unless the config changed.{hint}")


def clean_stale(dirpath: str) -> None:
    """Remove what interrupted saves left under ``dirpath``: temporary folders and links (never read), and
    folders set aside by an interrupted replace (put back when their name is free, else removed)."""
    for folder in (dirpath, os.path.join(dirpath, HIDDEN)):
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if name.startswith(TEMP_PREFIX):
                remove_entry(path)
            elif name.startswith(OLD_PREFIX):
                original = os.path.join(folder, name[len(OLD_PREFIX):].split("-", 2)[-1])
                if os.path.lexists(original):
                    remove_entry(path)
                else:
                    os.rename(path, original)
        fsync_dir(folder)


def prune_hidden(dirpath: str, keep: int = 2) -> None:
    """Keep the ``keep`` newest hidden ``.last/`` checkpoints (the one ``last.ckpt`` points to and a fallback)."""
    hidden = os.path.join(dirpath, HIDDEN)
    if not os.path.isdir(hidden):
        return
    target = last_target(dirpath)
    found = [path for path in entries(dirpath) if os.path.dirname(path) == hidden]
    for path in found[keep:]:
        if target is None or os.path.realpath(path) != os.path.realpath(target):
            remove_entry(path)


def wandb_run_id(path: str) -> Optional[str]:
    """The W&B run id checkpoint ``path`` was written under, or None (a single file, or no W&B logger).

    ``path`` is a checkpoint folder or a checkpoint directory (then ``last`` is resolved). The folder is verified
    like every read (``verify``; the resume that follows in the same process finds it verified already), then the
    id is read from the manifest: nothing is unpickled. A damaged checkpoint raises ``CheckpointError``."""
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, MANIFEST)) \
            and not os.path.isfile(os.path.join(path, STATE)):
        path = resolve_last(path, say=lambda message: None) or ""
    if not os.path.isdir(path):
        return None
    return verify(path).get("wandb_run_id")
