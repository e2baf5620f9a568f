"""Versions as Hugging Face model directories an engine loads, and `current`, switched atomically.

Owns `DIR/versions/vNNNNNNNNNN/` (one complete model directory per version:
the published shard layout, `model.safetensors.index.json`, the side files
that travelled with the version) and `DIR/current`, a symbolic link replaced
atomically (rename over it), only ever to a version whose directory is
complete and fsynced, so a reader that resolves `current` once sees one whole
version. A reader that opens its files through `current` one by one sees one
version only if `current` does not move meanwhile: for an engine that reloads
that way (vLLM), a version is written with `switch=False` and made current
later by `switch`, between reloads (node/engines.py `Handoff`).

`written` is the version written last: the next write's `changed` is relative
to it, and a shard none of whose tensors changed is hard-linked from it
instead of written again. It is newer than `current` while `current` is held
back. A version directory is removed only when it is neither current, nor
`written`, nor being written, nor held (`hold`/`release`: an engine still
loading it, or a version offered to it and not yet handed over).

At start `written` is the current version. A directory newer than it that a
crash left (written while `current` was held back) is no link source: a write
of the same version whose recorded metadata (version, swarm, state hash) it
holds takes it as written, without writing it again; any other is removed by
the first write's prune (or set aside, if it has the number but another
state).

Must not decide when to write or switch (the daemon's hand-off does) nor hold
the state: it is handed the tensors of the version to write.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from patchswarm.node import basefile
from patchswarm.node.checkpoint import INDEX_NAME, fsync_path, write_side_files
from patchswarm.protocol.errors import InvalidInput, UsageError

SINGLE_FILE = "model.safetensors"
CURRENT = "current"
FILE_MODE = 0o640  # the engine may run as another user of the node's group; others read nothing
VERSIONS = "versions"


def version_name(version: int) -> str:
    return f"v{version:010d}"


class ModelDir:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        (self.root / VERSIONS).mkdir(parents=True, exist_ok=True)
        self._held: dict[int, int] = {}
        self._shards: dict[int, dict[str, set[str]]] = {}  # version -> shard file -> its tensors
        self.written: int | None = self.current_version()  # the version written last (see the module's docstring)
        self._writing: int | None = None  # being written now (in a worker thread): a prune keeps it
        for stale in (self.root / VERSIONS).glob(".*"):  # a write a crash interrupted
            shutil.rmtree(stale, ignore_errors=True)
        (self.root / (CURRENT + ".tmp")).unlink(missing_ok=True)

    @property
    def current(self) -> Path:
        return self.root / CURRENT

    def current_version(self) -> int | None:
        try:
            target = os.readlink(self.current)
        except OSError:
            return None
        name = Path(target).name
        return int(name[1:]) if name.startswith("v") and name[1:].isdigit() else None

    def path(self, version: int) -> Path:
        return self.root / VERSIONS / version_name(version)

    def recorded(self, version: int) -> dict[str, str]:
        """The metadata written with `version` (its index's, or its single file's); {} where
        it does not read (the caller then writes the version again)."""
        d = self.path(version)
        try:
            if (d / INDEX_NAME).exists():
                meta = json.loads((d / INDEX_NAME).read_text()).get("metadata", {})
            else:
                meta = basefile.read_header(d / SINGLE_FILE)[2]
        except (OSError, ValueError, InvalidInput, AttributeError):
            return {}
        return {k: v for k, v in meta.items() if isinstance(v, str)} if isinstance(meta, dict) else {}

    def set_aside(self, version: int) -> None:
        """Remove `version`'s directory, which holds another state than its name says (left by
        another swarm or an earlier data dir), so that it is written again."""
        d = self.path(version)
        aside = d.with_name(f".{d.name}.stale")  # removed at the next start if this is cut short
        shutil.rmtree(aside, ignore_errors=True)
        if d.exists():
            os.rename(d, aside)
            shutil.rmtree(aside, ignore_errors=True)
        self._shards.pop(version, None)
        if self.written == version:
            self.written = None

    def write(self, version: int, state: dict[str, torch.Tensor], layout: dict[str, str] | None,
              files: dict[str, bytes], metadata: dict[str, str], changed: set[str] | None = None,
              switch: bool = True) -> int:
        """Write version `version`, make it `written` and, unless `switch` is False, current;
        returns the bytes written.

        `changed`: the tensors that differ from version `written` (the caller checks that it is
        the version before; None: all of them); a shard of only unchanged tensors, present in
        `written` with the same tensors, is hard-linked from it instead of written (not a single
        file: its header holds the version's metadata). Not the current version: while `current`
        is held back it is older than `written`, and its shards would bring back tensors that
        changed since. `switch` False: `current` stays (`switch` moves it later)."""
        final = self.path(version)
        shards = _shards_of(state, layout)
        n = 0
        (self.root / VERSIONS).mkdir(parents=True, exist_ok=True)  # removed under us: made again, not failed for ever
        if final.exists() and any(self.recorded(version).get(k) != v for k, v in metadata.items()):
            self.set_aside(version)  # left by another swarm or an earlier data dir: not this state
        self._writing = version
        try:
            if not final.exists():  # else: whole already (renamed only once complete), and a full disk stopped
                n = self._write_version(version, state, shards, layout, files, metadata, changed)
            self._shards[version] = shards
            if switch:
                self._link_current(version)
            self.written = version  # after the link: one that failed is made again by the next write
        finally:
            self._writing = None
        self.prune()
        return n

    def switch(self, version: int) -> None:
        """Make `version`, written before, current (atomically, fsynced), then prune; nothing to
        do where it is current already. One caller switches: the writes, or (`switch=False`
        writes) the engine's hand-off before each reload, never both."""
        if self.current_version() == version:
            return
        if not self.path(version).is_dir():
            raise InvalidInput(f"model dir: expected version {version} written in {self.path(version)} to make "
                               f"it current, found no such directory (current: {self.current_version()})")
        self._link_current(version)
        self.prune()

    def _link_current(self, version: int) -> None:
        link_tmp = self.root / (CURRENT + ".tmp")
        link_tmp.unlink(missing_ok=True)
        os.symlink(Path(VERSIONS) / version_name(version), link_tmp)
        os.replace(link_tmp, self.current)
        fsync_path(self.root)

    def _write_version(self, version: int, state: dict[str, torch.Tensor], shards: dict,
                       layout: dict[str, str] | None, files: dict[str, bytes], metadata: dict[str, str],
                       changed: set[str] | None) -> int:
        """The version's directory, written under a temporary name and renamed into place once whole."""
        final = self.path(version)
        prev_version = self.written  # what `changed` is relative to (not `current`, which may be older)
        prev = self.path(prev_version) if prev_version is not None else None
        prev_shards = self._shards.get(prev_version) if prev_version is not None else None
        tmp = self.root / VERSIONS / f".{version_name(version)}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        written = 0
        try:
            for shard, names in sorted(shards.items()):
                # A single file holds this version's metadata in its header: never the previous one's.
                unchanged = changed is not None and layout is not None and not (names & changed)
                if (unchanged and prev is not None and prev_shards is not None and prev_shards.get(shard) == names
                        and (prev / shard).exists()):
                    os.link(prev / shard, tmp / shard)
                    continue
                # "format": "pt" in every file: transformers' load_state_dict refuses a safetensors
                # file whose metadata lacks it ("does not contain the valid metadata").
                written += basefile.write(tmp / shard, {n: state[n] for n in sorted(names)},
                                          {"format": "pt", **metadata} if layout is None else {"format": "pt"},
                                          durable=False, mode=FILE_MODE)
            if layout is not None:
                total = sum(t.numel() * t.element_size() for n, t in state.items())
                index = {"metadata": {"total_size": total, **metadata},
                         "weight_map": {n: layout[n] for n in sorted(state)}}
                data = (json.dumps(index, indent=2) + "\n").encode()
                (tmp / INDEX_NAME).write_bytes(data)
                written += len(data)
            write_side_files(tmp, files)
            written += sum(len(d) for d in files.values())
            for f in tmp.iterdir():
                fsync_path(f)
            fsync_path(tmp)
            os.rename(tmp, final)
            fsync_path(final.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return written

    def hold(self, version: int) -> None:
        """Keep `version`'s directory while someone reads it (an engine loading it)."""
        self._held[version] = self._held.get(version, 0) + 1

    def release(self, version: int, prune: bool = True) -> None:
        """`version` is no longer read by one holder; with `prune` False the caller prunes
        later (node/modelsink.py does it off the event loop: a version's directory may hold
        the whole model)."""
        n = self._held.get(version, 0) - 1
        if n > 0:
            self._held[version] = n
        else:
            self._held.pop(version, None)
        if prune:
            self.prune()

    def prune(self) -> None:
        """Remove every version directory that is neither current, nor `written` (the next
        write's link source, and the next switch's target), nor being written, nor held. What
        to keep is read after the listing: a write in another thread renames its directory in
        only after it marked it as being written."""
        try:
            entries = list((self.root / VERSIONS).iterdir())
        except OSError:  # removed under us (or unreadable): nothing to prune; the next write makes it again
            return
        writing = self._writing  # before `written`: a write sets `written` before it clears `_writing`
        keep = {self.current_version(), writing, self.written}
        for d in entries:
            if not d.name.startswith("v") or not d.name[1:].isdigit():
                continue
            v = int(d.name[1:])
            if v not in keep and v not in self._held:
                shutil.rmtree(d, ignore_errors=True)
                self._shards.pop(v, None)


def _shards_of(state: dict[str, torch.Tensor], layout: dict[str, str] | None) -> dict[str, set[str]]:
    if layout is None:
        return {SINGLE_FILE: set(state)}
    missing = sorted(set(state) - set(layout))
    if missing:
        raise UsageError(f"model dir: the layout names no shard for {missing[:3]} ({len(missing)} in all)")
    out: dict[str, set[str]] = {}
    for name in state:
        out.setdefault(layout[name], set()).add(name)
    return out
