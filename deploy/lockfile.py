"""Print deploy/requirements.lock: patchswarm's runtime dependencies and theirs, at the installed versions.

Run it in the venv the tests passed in, after a dependency change:
    .venv/bin/python deploy/lockfile.py > deploy/requirements.lock
Local version labels (torch's +cpu) are dropped: the Dockerfile takes torch from the CPU index.
"""

from __future__ import annotations

import importlib.metadata as md
import re

HEADER = """\
# The image's Python packages, pinned: patchswarm's runtime dependencies and theirs, at the versions
# its tests ran with. deploy/Dockerfile installs with `-c` this file (torch from the CPU index).
# Made by `.venv/bin/python deploy/lockfile.py > deploy/requirements.lock`; tests/test_deploy.py
# checks that every runtime dependency in pyproject.toml is pinned here."""


def closure(root: str = "patchswarm") -> dict[str, str]:
    """Normalized name -> version of every distribution `root` needs at run time (extras excluded)."""
    seen: dict[str, str] = {}

    def walk(name: str) -> None:
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            return
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            return  # a marker excluded it on this platform
        seen[key] = dist.version.split("+")[0]
        for req in dist.requires or []:
            if "extra ==" not in req:
                walk(re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0])

    walk(root)
    del seen[root]
    return seen


if __name__ == "__main__":
    print(HEADER)
    for name, version in sorted(closure().items()):
        print(f"{name}=={version}")
