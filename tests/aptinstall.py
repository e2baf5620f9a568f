"""A command a test needs from Debian's packages: found on PATH, installed with apt-get, or the test is skipped.

CI starts on a fresh machine: a test that needs chromium or systemd-analyze
installs the package itself (as root, where apt-get exists) instead of relying
on anything installed by hand, and says why it is skipped where it cannot.
PATCHSWARM_TEST_NO_APT=1 turns installing off (the test is skipped instead).
The suite runs in several pytest-xdist workers: one installs at a time (a file
lock), so that apt's own lock never makes a second install fail into a skip.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess

import pytest

INSTALL_SECONDS = 900
LOCK = "/tmp/patchswarm-tests-apt.lock"


def _apt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["apt-get", *args], capture_output=True, text=True, timeout=INSTALL_SECONDS,
                          env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, stdin=subprocess.DEVNULL)


def ensure_command(command: str, package: str) -> str:
    """The path of `command`, installing Debian's `package` if it is missing; pytest.skip if it cannot be had."""
    path = shutil.which(command)
    if path:
        return path
    if os.environ.get("PATCHSWARM_TEST_NO_APT"):
        pytest.skip(f"{command} is not installed and PATCHSWARM_TEST_NO_APT is set")
    if not shutil.which("apt-get") or os.geteuid() != 0:
        pytest.skip(f"{command} is not installed, and {package} cannot be installed here (needs root and apt-get)")
    with _one_installer():
        path = shutil.which(command)  # another worker may have installed it meanwhile
        if path:
            return path
        r = _apt("install", "-y", "--no-install-recommends", package)
        if r.returncode != 0:  # a fresh machine's package lists may be missing or old
            _apt("update")
            r = _apt("install", "-y", "--no-install-recommends", package)
    path = shutil.which(command)
    if r.returncode != 0 or not path:
        tail = " ".join((r.stderr or r.stdout).split()[-30:])
        pytest.skip(f"{command} is not installed and `apt-get install {package}` failed: {tail}")
    return path


@contextlib.contextmanager
def _one_installer():
    """Hold the suite's apt lock (waits for another worker's install to end; closing releases it)."""
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield
