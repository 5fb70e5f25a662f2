"""Start the ``posttrain`` command as its own process, without paying its imports every time.

A ``python -m posttrain`` process spends about 12 CPU-seconds importing (Lightning with torchmetrics, diffusers,
transformers, W&B) before it does anything, and the suite starts well over a hundred of them (kill/resume chains,
two-process runs, recipes). Here one server process per test worker imports all of that once
(``multiprocessing``'s forkserver with a preload); every command is a fresh fork of it that then runs exactly what
``python -m posttrain`` runs (``runpy`` on ``posttrain/__main__.py``) in its own session, with the given
environment, working directory and argv, stdout and stderr in files. It is a real process: it can be killed (the
kill tests kill its whole process group), it exits with the command's status (−9 when killed), and the processes
Lightning's launcher starts for the other ranks re-run ``python -m posttrain.__main__`` from scratch.

The other ranks of a multi-process command are forked from the same server too: the command's Lightning launcher
starts rank k with ``subprocess.Popen([python, "-m", "posttrain.__main__", ...])``; here that call forks rank k
instead (same argv, environment, working directory, file-size limit, and the same open stdout/stderr), and returns
a handle that polls, waits and signals as a ``Popen`` does. A forked rank cannot join rank 0's session, so each
rank leads its own, and a job is the set of sessions its ranks registered in its folder: ``kill_job`` (a node going
down) and a timeout kill them all at once; a rank whose rank 0 is gone leaves after a grace period, as its
collectives would fail anyway.

What differs from a cold start: the modules of the preload are already imported (with the environment the server
started with: this worker's). ``module`` runs ``python -m <module>`` (a bench, an experiment) and ``script`` a
script file the same way, ``spawn`` is ``torch.multiprocessing.spawn`` on the same server. Tests about the
command's own start-up — its warnings, the console script, the installed wheel — run it cold (tests/test_cli.py,
tests/test_packaging.py).
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import traceback
from typing import Optional

# Not W&B: it makes a temporary media folder when imported, which the first command's exit would delete for all.
PRELOAD = ["posttrain.lit.tools.cli"]
_context = None


def context():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


class _Inherited:
    """An open file descriptor handed to a forked process (what ``Popen`` children inherit): sent over the
    forkserver's socket when pickled for it (``multiprocessing.reduction.DupFd``), an ``int`` again in the child."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


def _command(script: Optional[str], args: list[str], env: dict[str, str], cwd: str, out, err,
             max_file_bytes: Optional[int], job: str, server: str, rank0: Optional[int] = None,
             module: str = "posttrain") -> None:
    """The forked child: become ``python -m module *args`` (``python script *args`` when ``script`` is given)
    started in a new session, then exit as it would. ``out``/``err``: paths to create, or descriptors to share (a
    rank the command started: ``rank0`` is the pid of the rank that started it)."""
    os.setsid()  # its own process group: a kill of the job takes the processes it starts, and nothing else
    if max_file_bytes is not None:  # as on a full disk: a write past it fails with EFBIG instead of a SIGXFSZ kill
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))
    for fd, target in ((1, out), (2, err)):
        if isinstance(target, str):
            target = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    if rank0 is not None:
        _leave_without(rank0)
    _register(job, os.getpid())
    env = dict(env, POSTTRAIN_TEST_JOB=job)
    _fork_ranks(server)
    multiprocessing.set_start_method(None, force=True)  # the platform's default, as in a fresh interpreter (a
    # forkserver child inherits "forkserver", under which DataLoader workers would have to pickle their dataset)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # A fork inherits the server's sys.path (this worker's: the repository root and tests/ on it), not the one a fresh
    # interpreter would build: what the interpreter adds, PYTHONPATH here and a script's folder below, is added by hand.
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    import torch

    if env.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [module if script is None else script, *args]
    code = 0
    try:
        if script is None:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as the interpreter does for a script
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:  # what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # a process's exit handlers (W&B's among them); multiprocessing skips them
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _register(job: str, pid: int) -> None:
    with open(os.path.join(job, "pids"), "a") as f:
        f.write(f"{pid}\n")


def _job_pids(job: str) -> list[int]:
    try:
        with open(os.path.join(job, "pids")) as f:
            return [int(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _kill_sessions(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def kill_job() -> None:
    """SIGKILL the whole job this process belongs to, every rank at once (as when a node goes down)."""
    job = os.environ.get("POSTTRAIN_TEST_JOB")
    others = [pid for pid in _job_pids(job) if pid != os.getpid()] if job else []
    _kill_sessions(others)
    os.killpg(os.getpgid(0), signal.SIGKILL)


def _leave_without(rank0: int, grace: float = 10.0) -> None:
    """A started rank exits (status 1) ``grace`` seconds after its rank 0 is gone."""
    import threading
    import time

    def watch() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(rank0, 0)
            except ProcessLookupError:
                time.sleep(grace)
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="rank-0-watch").start()


class _Rank:
    """What Lightning's launcher keeps of a rank it started: ``subprocess.Popen``'s ``pid``, ``returncode``,
    ``poll``, ``wait``, ``send_signal``, ``terminate`` and ``kill``, on a forked process."""

    def __init__(self, process):
        self._process = process
        self.pid = process.pid
        self.args = None

    @property
    def returncode(self) -> Optional[int]:
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        from multiprocessing.connection import wait

        if self.poll() is None and not wait([self._process.sentinel], timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.poll()

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _fork_ranks(server: str) -> None:
    """In a forked command: the ranks its Lightning launcher starts, and the processes a bench script starts with
    ``torch.multiprocessing.spawn``, are forked from the same server."""
    import types
    from multiprocessing import forkserver, process

    import torch.multiprocessing

    forkserver._forkserver._forkserver_address = server  # the alive and resource-tracker fds come with the fork
    forkserver._forkserver.ensure_running = lambda: None
    torch.multiprocessing.spawn = forked_spawn

    def popen(command, env=None, cwd=None, **kwargs):
        command = list(command)
        if kwargs or command[:3] != [sys.executable, "-m", "posttrain.__main__"]:  # ``-m __main__.__spec__.name``
            return subprocess.Popen(command, env=env, cwd=cwd, **kwargs)
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        job = os.environ["POSTTRAIN_TEST_JOB"]
        rank = context().Process(target=_command, args=(
            None, command[3:], dict(os.environ if env is None else env), cwd or os.getcwd(), _Inherited(1),
            _Inherited(2), None if limit == resource.RLIM_INFINITY else limit, job, server, os.getpid()))
        rank.start()
        process._children.discard(rank)  # not joined at exit: a Popen child is not waited for either
        _register(job, rank.pid)
        handle = _Rank(rank)
        handle.args = command
        return handle

    shim = types.SimpleNamespace(**{name: getattr(subprocess, name) for name in dir(subprocess)
                                    if not name.startswith("__")})
    shim.Popen = popen
    from lightning.fabric.strategies.launchers import subprocess_script as fabric_launcher
    from lightning.pytorch.strategies.launchers import subprocess_script as launcher

    launcher.subprocess = shim
    fabric_launcher.subprocess = shim


def posttrain(*args: str, cwd: str, env: Optional[dict[str, str]] = None, timeout: float = 600,
              max_file_bytes: Optional[int] = None, script: Optional[str] = None,
              module_name: str = "posttrain") -> subprocess.CompletedProcess:
    """``python -m posttrain *args`` (``python -m module_name *args``, or ``python script *args`` with ``script``)
    run to its end, as ``subprocess.run(..., capture_output=True, text=True)`` returns it
    (``subprocess.TimeoutExpired`` past ``timeout``, after killing the job)."""
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="posttrain-command-") as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        process = context().Process(target=_command, args=(
            script, list(args), env, str(cwd), out, err, max_file_bytes, folder, _server_address()),
            kwargs={"module": module_name})
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            _kill_sessions(sorted(set(_job_pids(folder)) | {process.pid}))
            process.join()
            raise subprocess.TimeoutExpired(["posttrain", *args], timeout, output=read(out), stderr=read(err))
        # the other ranks write to the same files and may still be saying their last words (a pipe's EOF, which
        # subprocess.run waits for, waits for every writer): wait for them, as long as a rank outlives its rank 0
        _wait_for_exit([pid for pid in _job_pids(folder) if pid != process.pid], timeout=15.0)
        return subprocess.CompletedProcess(["posttrain", *args], process.exitcode, read(out), read(err))


def _wait_for_exit(pids: list[int], timeout: float) -> None:
    import time

    deadline = time.monotonic() + timeout
    for pid in pids:
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (an exited process its parent has not reaped yet does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _server_address() -> str:
    from multiprocessing import forkserver

    forkserver._forkserver.ensure_running()
    return forkserver._forkserver._forkserver_address


def module(name: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
    """``python -m name *args`` (a bench or an experiment: ``bench.overhead``, ``experiments.distill``), forked and
    returned as ``posttrain`` does."""
    return posttrain(*args, module_name=name, **kwargs)


def script(path: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
    """``python path *args`` (a script file), forked and returned as ``posttrain`` does."""
    return posttrain(*args, script=path, **kwargs)


def forked_spawn(fn, args: tuple = (), nprocs: int = 1, join: bool = True, **kwargs):
    """What ``torch.multiprocessing.spawn`` is, with its processes forked from this worker's server (a test sets it
    in place of ``torch.multiprocessing.spawn`` for code under test that spawns)."""
    import torch.multiprocessing

    context()
    return torch.multiprocessing.start_processes(fn, args=args, nprocs=nprocs, join=join,
                                                 **{**kwargs, "start_method": "forkserver"})


def spawn(fn, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` with its processes forked from the same server (``fn`` is
    called as ``fn(rank, *args)``; an exception in any process is raised here)."""
    import torch.multiprocessing

    context()
    torch.multiprocessing.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()
