"""The node's change log: what each applied version wrote, element by element, as files an engine follows.

Owns `DATA_DIR/changes/`: one file `<version>.chg` per applied version, a
change stream (protocol/changes.py) from the version before it. A file is
written while the version is applied (the patch decoder hands each write to
the encoder, which goes straight to a temporary file: memory does not grow
with the version) and renamed into place only if the apply succeeded; a
temporary left by a crash is removed when the log is opened. `retire(floor)`
drops the files of versions at or below `floor` (the applier keeps what
the store keeps: every version after the base, so an engine that reads the
base file follows the files after it, and the window late peers ask for).

`chain(after, upto)` opens, in order, the files that take a state at version
`after` to version `upto`, or says there is no such chain (the engine must
bootstrap from the base file): the files are opened before any is read, so
a retire meanwhile does not cut a stream short. Must not decide what to
apply, nor talk to engines (node/localapi.py streams the files).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import BinaryIO, Iterator

from patchswarm.protocol.changes import PREFIX_BYTES, ChangeEncoder, VersionHeader, decode_frame, frame_prefix
from patchswarm.protocol.errors import InvalidInput
from patchswarm.protocol.patch import Patch

log = logging.getLogger("patchswarm.changelog")
SUFFIX = ".chg"
DIRNAME = "changes"


class Changelog:
    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        for p in self.dir.glob(f"*{SUFFIX}.tmp"):  # a crash while recording: the version was not applied
            p.unlink(missing_ok=True)

    def path(self, version: int) -> Path:
        return self.dir / f"{version:010d}{SUFFIX}"

    def versions(self) -> list[int]:
        out = []
        for p in self.dir.glob(f"*{SUFFIX}"):
            try:
                out.append(int(p.name[:-len(SUFFIX)]))
            except ValueError:
                continue
        return sorted(out)

    @contextlib.contextmanager
    def recording(self, patch: Patch, base: tuple[int, str] | None, version: int) -> Iterator[ChangeEncoder | None]:
        """The recorder for applying `patch` (protocol/patch.py `apply(..., recorder=)`) to a
        state at `base` (version, state hash); the file is in place when the block ends
        without an error, and absent otherwise. None (nothing recorded) when there is no
        base: an engine starts from the base file, not from a stream of the whole state."""
        if base is None:
            yield None
            return
        final = self.path(version)
        tmp = final.with_name(final.name + ".tmp")
        with open(tmp, "wb") as f:
            try:
                enc = ChangeEncoder.for_patch(patch, base, version, f.writelines)
                enc.header()
                yield enc
                enc.end()
                # Durable before it is named: a restart replays the stored chain without
                # recording it again, so a file lost to a power loss would break the chain
                # engines follow until the base moves past it.
                f.flush()
                os.fdatasync(f.fileno())
            except BaseException:
                with contextlib.suppress(OSError):  # a full disk fails the close's flush too
                    f.close()
                tmp.unlink(missing_ok=True)
                raise
        os.replace(tmp, final)

    def header(self, version: int) -> VersionHeader | None:
        """The header of `version`'s file, or None if it is absent or does not read."""
        try:
            with open(self.path(version), "rb") as f:
                return _read_header(f)
        except (OSError, InvalidInput):
            return None

    def chain(self, after: int, after_hash: str | None, upto: int, upto_hash: str) -> list[BinaryIO] | None:
        """The open files that take the state at (`after`, `after_hash`) to (`upto`,
        `upto_hash`), in order ([] when `after == upto`), or None if the log does not
        hold them all. `after_hash` None: not checked (the engine checks the stream's
        hashes against what it holds)."""
        if after > upto:
            return None
        files: list[BinaryIO] = []
        prev = (after, after_hash)
        try:
            # The files held, not every version number between: a client's `after` may be far
            # behind, and a failed open per version cost ~9 us (4.4 s from 0 at 500,000).
            for v in [v for v in self.versions() if after < v <= upto]:
                try:
                    f = open(self.path(v), "rb")
                except FileNotFoundError:
                    # A patch from an older base skips versions; the next file says so.
                    continue
                files.append(f)
                h = _read_header(f)
                f.seek(0)
                if h.base_version != prev[0] or (prev[1] is not None and h.base_hash != prev[1]):
                    raise InvalidInput(f"{f.name}: expected a version after {prev[0]}, found one after {h.base_version}")
                prev = (h.target_version, h.target_hash)
            if prev[0] != upto or (files and prev[1] != upto_hash):
                raise InvalidInput(f"changes: expected a chain to {upto} ({upto_hash[:23]}…), found one to {prev[0]}")
        except (OSError, InvalidInput) as e:
            log.debug("no change chain %d -> %d: %s", after, upto, e)
            for f in files:
                f.close()
            return None
        return files

    def retire(self, floor: int) -> None:
        """Drop the files of versions at or below `floor`."""
        for v in self.versions():
            if v <= floor:
                self.path(v).unlink(missing_ok=True)


def _read_header(f: BinaryIO) -> VersionHeader:
    prefix = f.read(PREFIX_BYTES)
    if len(prefix) != PREFIX_BYTES:
        raise InvalidInput(f"{f.name}: expected a change stream, found {len(prefix)} bytes")
    n, crc = frame_prefix(prefix)
    h = decode_frame(f.read(n), crc)
    if not isinstance(h, VersionHeader):
        raise InvalidInput(f"{f.name}: expected a header first, found {type(h).__name__}")
    return h
