"""The wheel installs one top-level package, ``posttrain`` (its folders stay at the repository's top)."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_wheel_has_one_top_level_name(tmp_path):
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                            "-w", str(tmp_path), ROOT], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = [f for f in os.listdir(tmp_path) if f.endswith(".whl")]
    with zipfile.ZipFile(tmp_path / wheel) as z:
        names = z.namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"posttrain"}, top
    for package in ("lit", "modules", "datamodules", "callbacks"):
        assert f"posttrain/{package}/__init__.py" in names
    assert "posttrain/__main__.py" in names
    assets = os.path.join(ROOT, "modules", "assets")
    shipped = {os.path.relpath(os.path.join(d, f), ROOT) for d, _, files in os.walk(assets) for f in files}
    assert shipped and {f"posttrain/{p}" for p in shipped} <= set(names), sorted(  # every shipped world, each level
        p for p in shipped if f"posttrain/{p}" not in names)
    assert not any(n.startswith("posttrain/tests/") for n in names)
