"""The test harness's forked commands (tests/launch.py): a job is every rank it started, and a kill takes them all.

The kill tests (tests/test_kill_anywhere.py) trust ``launch.kill_job`` to kill a two-process job as a node going
down would: every rank at the same instant. Here a forked command starts a second rank the way Lightning's launcher
does (its ``subprocess.Popen`` of ``python -m posttrain.__main__``, forked from the server) and then kills the job.
If the kill missed the started rank, that rank would live on until its own watch of rank 0 notices (10 s later).
"""
from __future__ import annotations

import os
import re
import textwrap
import time

import launch
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import os, sys, time
from lightning.pytorch.strategies.launchers import subprocess_script

import launch  # tests/, on PYTHONPATH

if __name__ == "__main__":  # a forked rank imports the main script again (as __mp_main__), as spawn does
    # what Lightning's launcher does for rank 1: the same interpreter, ``-m posttrain.__main__`` (a long fit here)
    rank = subprocess_script.subprocess.Popen(
        [sys.executable, "-m", "posttrain.__main__", "fit", "--config", {config!r}, "--trainer.max_steps=100000",
         "--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]",
         "--trainer.default_root_dir=" + os.path.join(os.getcwd(), "rank1")])
    print("rank", rank.pid, type(rank).__name__, flush=True)
    time.sleep(2.0)
    print("alive", rank.poll() is None, flush=True)
    launch.kill_job()
    print("not killed", flush=True)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_kill_job_takes_the_rank_a_forked_command_started(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(textwrap.dedent(SCRIPT.format(config=os.path.join(ROOT, "configs", "finetune.yaml"))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(ROOT, "tests"),
                                                                    os.environ.get("PYTHONPATH")])))
    done = launch.script(str(script), cwd=str(tmp_path), env=env, timeout=120)
    killed = time.monotonic()
    # the script's own words (the started rank shares its stdout, and its progress bar writes no newline before
    # them, so they are found anywhere in a line)
    started = re.search(r"rank (\d+) (\w+)", done.stdout)
    checked = re.search(r"alive (True|False)", done.stdout)
    assert done.returncode == -9, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "not killed" not in done.stdout, done.stdout
    assert started, done.stdout
    pid, kind = started.groups()
    assert kind == "_Rank", f"the launcher's Popen started a cold process ({kind}), not a forked rank"
    assert checked and checked[1] == "True", (  # the script's own output and the rank's, should the job die early
        f"rank 1 was gone before the kill, or the script before its check:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    while alive(int(pid)) and time.monotonic() - killed < 3.0:  # the server reaps it
        time.sleep(0.05)
    assert not alive(int(pid)), "rank 1 outlived the job's kill (it would only leave 10 s after rank 0)"
