"""Start the ``posttrain`` command as its own process, without paying its imports every time.

A ``python -m posttrain`` process spends about 12 CPU-seconds importing (Lightning with torchmetrics, diffusers,
transformers, W&B) before it does anything, and the suite starts well over a hundred of them (kill/resume chains,
two-process runs, recipes). Here one server process per test worker imports all of that once
(``multiprocessing``'s forkserver with a preload); every command is a fresh fork of it that then runs exactly what
``python -m posttrain`` runs (``runpy`` on ``posttrain/__main__.py``) in its own session, with the given
environment, working directory and argv, stdout and stderr in files. It is a real process: it can be killed (the
kill tests kill its whole process group), it exits with the command's status (−9 when killed), and the processes
Lightning's launcher starts for the other ranks re-run ``python -m posttrain.__main__`` from scratch.

What differs from a cold start: the modules of the preload are already imported (with the environment the server
started with: this worker's). ``script`` runs a bench script the same way, ``spawn`` is
``torch.multiprocessing.spawn`` on the same server. Tests about the command's own start-up — its warnings, the
console script, the installed wheel — run it cold (tests/test_cli.py, tests/test_packaging.py).
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


def _command(script: Optional[str], args: list[str], env: dict[str, str], cwd: str, out: str, err: str,
             max_file_bytes: Optional[int]) -> None:
    """The forked child: become ``python -m posttrain *args`` (``python script *args`` when ``script`` is given)
    started in a new session, then exit as it would."""
    os.setsid()  # its own process group: a kill of the job takes the ranks it starts, and nothing else
    if max_file_bytes is not None:  # as on a full disk: a write past it fails with EFBIG instead of a SIGXFSZ kill
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    multiprocessing.set_start_method(None, force=True)  # the platform's default, as in a fresh interpreter (a
    # forkserver child inherits "forkserver", under which DataLoader workers would have to pickle their dataset)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    import torch

    if env.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = ["posttrain" if script is None else script, *args]
    code = 0
    try:
        if script is None:
            runpy.run_module("posttrain", run_name="__main__", alter_sys=True)
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


def posttrain(*args: str, cwd: str, env: Optional[dict[str, str]] = None, timeout: float = 600,
              max_file_bytes: Optional[int] = None, script: Optional[str] = None) -> subprocess.CompletedProcess:
    """``python -m posttrain *args`` (``python script *args`` with ``script``: a bench) run to its end, as
    ``subprocess.run(..., capture_output=True, text=True)`` returns it (``subprocess.TimeoutExpired`` past
    ``timeout``, after killing the job)."""
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="posttrain-command-") as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        process = context().Process(target=_command,
                                    args=(script, list(args), env, str(cwd), out, err, max_file_bytes))
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.join()
            raise subprocess.TimeoutExpired(["posttrain", *args], timeout, output=read(out), stderr=read(err))
        return subprocess.CompletedProcess(["posttrain", *args], process.exitcode, read(out), read(err))


def script(path: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
    """``python path *args`` (a bench script), forked and returned as ``posttrain`` does."""
    return posttrain(*args, script=path, **kwargs)


def spawn(fn, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` with its processes forked from the same server (``fn`` is
    called as ``fn(rank, *args)``; an exception in any process is raised here)."""
    import torch.multiprocessing

    context()
    torch.multiprocessing.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()
