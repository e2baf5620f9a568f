"""The installed distribution: one `patchswarm` namespace, nothing generic at the top of site-packages.

Run from a directory that holds `protocol.py`, `node.py` and `tracker.py` (names a
user's own project may well have): the client still imports and the command still
runs, because nothing of ours is called `protocol`, `node` or `tracker`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture
def crowded_dir(tmp_path):
    for name in ("protocol", "node", "tracker"):
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('the user\\'s own {name}.py was imported')\n")
    return tmp_path


def test_client_imports_beside_modules_named_like_the_old_packages(crowded_dir):
    r = subprocess.run([sys.executable, "-c", "from patchswarm.node.client import NodeClient; "
                        "from patchswarm.node.trainer import SyncOrigin; print(NodeClient.__module__)"],
                       cwd=crowded_dir, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "patchswarm.node.client"


def test_the_command_runs_beside_modules_named_like_the_old_packages(crowded_dir):
    exe = BIN / "patchswarm"
    assert exe.exists(), f"no console script at {exe}"
    r = subprocess.run([str(exe), "--help"], cwd=crowded_dir, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for name in ("diff", "tracker", "origin", "node", "status"):
        assert name in r.stdout
    r = subprocess.run([sys.executable, "-m", "patchswarm.node.cli", "tracker", "--help"], cwd=crowded_dir,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--listen" in r.stdout, r.stderr


@pytest.mark.slow
def test_the_wheel_holds_only_the_patchswarm_namespace(tmp_path):
    # Built from a copy of the tracked files: a build leaves build/ and egg-info where it runs.
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    wheels = list((tmp_path / "dist").glob("patchswarm-*.whl"))
    assert len(wheels) == 1, wheels
    names = zipfile.ZipFile(wheels[0]).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"patchswarm", next(t for t in tops if t.endswith(".dist-info"))}, sorted(tops)
    for package in ("protocol", "node", "node/net", "node/trainer", "node/cli", "tracker"):
        assert f"patchswarm/{package}/__init__.py" in names, package
    assert any(n.startswith("patchswarm/protocol/_kernels") for n in names), "the compiled kernels are missing"
    assert not any(n.startswith("patchswarm/tests") or "/synthetic.py" in n for n in names)
