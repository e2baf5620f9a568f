"""The import graph has no arrow from a lower layer to a higher one and no cycle between rooms.

Every module under protocol/, node/ and tracker/ is parsed with `ast` (nothing is
imported), each import resolved to the room it lands in, and checked against
the table below: a room may import only the rooms listed for it (and itself).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"protocol": "patchswarm.protocol", "node": "patchswarm.node", "tracker": "patchswarm.tracker"}

# room -> rooms it may import. Lowest first: protocol is sans-IO and imports no
# other room; the network layer is shared by every member and the tracker; the
# daemon's modules (node/*.py) serve the trainer side too; the CLI sits on top
# (it reaches tracker/ by a module path string, not an import).
# The tracker reaches node/ only through the network layer.
MAY_IMPORT = {
    "protocol": set(),
    "node.net": {"protocol"},
    "node": {"protocol", "node.net"},
    "node.trainer": {"protocol", "node.net", "node"},
    "tracker": {"protocol", "node.net"},
    "node.demo": {"protocol", "node.net", "node", "node.trainer"},
    "node.cli": {"protocol", "node.net", "node", "node.trainer", "node.demo"},
}


def _room(dotted: str) -> str | None:
    """The room of a module path like patchswarm.node.net.transport (None: not ours)."""
    if not dotted.startswith("patchswarm."):
        return None
    parts = dotted.split(".")[1:]
    if parts[0] == "node" and len(parts) > 1 and f"node.{parts[1]}" in MAY_IMPORT:
        return f"node.{parts[1]}"
    return parts[0] if parts[0] in PACKAGES else None


def _modules():
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            is_package = path.name == "__init__.py"
            yield name, is_package, path


def _imports(name: str, is_package: bool, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    here = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)  # `from pkg import module`
    return found


def _edges() -> dict[str, set[tuple[str, str]]]:
    """room -> {(importing module, imported module)} for imports that land in another room."""
    edges: dict[str, set[tuple[str, str]]] = {}
    for name, is_package, path in _modules():
        src = _room(name)
        for target in _imports(name, is_package, path):
            dst = _room(target)
            if dst is not None and dst != src:
                edges.setdefault(src, set()).add((name, target))
    return edges


def test_old_top_level_names_are_gone():
    bad = [(name, t) for name, is_package, path in _modules() for t in _imports(name, is_package, path)
           if t.split(".")[0] in PACKAGES]
    assert not bad, f"imports of the old top-level packages: {sorted(bad)[:10]}"


def test_every_room_imports_only_the_rooms_below_it():
    violations = []
    for src, pairs in _edges().items():
        for module, target in pairs:
            if _room(target) not in MAY_IMPORT[src]:
                violations.append(f"{module} ({src}) imports {target} ({_room(target)})")
    assert not violations, "\n".join(sorted(violations))


def test_no_cycle_between_rooms():
    graph = {src: {_room(t) for _, t in pairs} for src, pairs in _edges().items()}
    state: dict[str, int] = {}

    def visit(room: str, path: list[str]) -> None:
        state[room] = 1
        for nxt in graph.get(room, ()):
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join(path + [room, nxt])}"
            if nxt not in state:
                visit(nxt, path + [room])
        state[room] = 2

    for room in graph:
        if room not in state:
            visit(room, [])


def test_the_table_is_a_layering():
    """MAY_IMPORT itself allows no cycle, so the two tests above together forbid one."""
    order = []
    left = dict(MAY_IMPORT)
    while left:
        ready = [r for r, deps in left.items() if deps <= set(order)]
        assert ready, f"MAY_IMPORT has a cycle among {sorted(left)}"
        order += ready
        for r in ready:
            del left[r]
