"""A real full disk for tests and benches: a small tmpfs mounted on a member's data dir, and a filler.

`SmallDisk(path, size)` mounts a tmpfs of `size` bytes at `path` (root only:
`available()` says why not, and tests skip with that reason), `fill(leave)`
writes a filler file that takes all but `leave` bytes of its free space (the
disk is then really full: writes fail with ENOSPC), `free()` removes it
("space is freed"), and leaving the block unmounts (lazily, should a process
still hold a file there). Nothing is mocked: every write of the member goes to
this file system.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

FILLER = ".filler"  # a dot name: no member reads or judges it


def available() -> str | None:
    """None if a tmpfs can be mounted here, else why not."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", d], capture_output=True, text=True)
        if r.returncode != 0:
            return f"mount -t tmpfs is not permitted here: {r.stderr.strip()}"
        subprocess.run(["umount", d], check=True)
    return None


class SmallDisk:
    def __init__(self, path: Path, size: int):
        self.path = Path(path)
        self.size = size
        self.mounted = False

    def __enter__(self) -> "SmallDisk":
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size},mode=0700", "tmpfs", str(self.path)],
                       check=True, capture_output=True)
        self.mounted = True
        return self

    def __exit__(self, *exc) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False, capture_output=True)
            self.mounted = False

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def fill(self, leave: int = 0) -> int:
        """Take all but `leave` bytes of the free space (the filler grows if called again);
        returns the filler's size."""
        filler = self.path / FILLER
        have = filler.stat().st_size if filler.exists() else 0
        want = have + max(0, self.free_bytes() - leave)
        with open(filler, "ab") as f:
            os.posix_fallocate(f.fileno(), 0, want)
        return want

    def free(self) -> None:
        (self.path / FILLER).unlink(missing_ok=True)


def leftovers(directory: Path) -> list[str]:
    """Temporaries of writes anywhere under a member's data dir (the store's `.NAME.PID.tmp`,
    the base's `.tmp-`/`.compact-`, the spool's `state.tmp`/`acks.tmp`, a ledger's `.tmp`),
    and object folders without a manifest (a publish or fetch cut short)."""
    out = []
    for root, dirs, files in os.walk(directory):
        for name in files:
            if name == FILLER:
                continue
            if name.endswith(".tmp") or ".tmp-" in name or ".compact-" in name:
                out.append(os.path.relpath(os.path.join(root, name), directory))
        if Path(root).parent.name == "objects" and "manifest" not in files:
            out.append(os.path.relpath(root, directory) + "/ (no manifest)")
    return sorted(out)
