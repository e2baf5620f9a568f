"""Which checkpoints of a watched directory the origin publishes, and when (`--watch`).

Owns `Watch`: poll by poll, the checkpoints (a `.safetensors` file, or a model directory
of shards, its index and side files) that are whole and unchanged since the previous
poll, in name order with numbers by value (`checkpoint-500` before `checkpoint-1000`).
Trainers save in place, shard after shard and the index last, so a checkpoint seen
mid-save must wait: a file is whole when its size is what its header says, a directory
when every shard its index names is whole and holds what the index puts there (one
unindexed file: that file; several and no index: not yet). One not whole yet is looked
at again at the next poll and never marked done; one that is whole but unreadable goes
to publish, which refuses it and says why. The wholeness check is pure (`_shard_of`,
`_not_whole`, over what a poll listed and read); `Watch.ready` does the listing and
reading, and must run off the event loop (it reads headers). Must not publish, nor keep
the ledger of what was published (node/trainer/origin.py does both).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import stat
from pathlib import Path

from patchswarm.node.checkpoint import INDEX_NAME, SUFFIX, read_index
from patchswarm.protocol.errors import InvalidInput

log = logging.getLogger("patchswarm.origin")


def _name_order(p: Path) -> tuple:
    """A checkpoint's place in the watch's order: its name with each run of digits compared
    as a number (a trainer's checkpoint-500 comes before its checkpoint-1000, as step9 before
    step10), then the name itself."""
    parts = re.split(r"(\d+)", p.name)  # text, digits, text, ...: the same kind at each index
    return tuple(int(x) if i % 2 else x for i, x in enumerate(parts)), p.name


# Names a writer gives a checkpoint before it is in place: hidden, "*.tmp*", "*.partial", "*~",
# and "tmp-checkpoint-N" (transformers' Trainer saved there, then renamed it to checkpoint-N,
# in some versions: taken under both names, it was published twice).
_TEMP = re.compile(r"(^\.)|(\.tmp)|(\.partial$)|(~$)|(^tmp-checkpoint-)")
# Hugging Face's shard names: model-00001-of-00003.safetensors. One of several is never a
# whole model on its own, whatever else the directory holds: its index comes last.
_SHARD_OF = re.compile(r"-(\d+)-of-(\d+)" + re.escape(SUFFIX) + "$")
_MAX_HEADER = 100 << 20  # safetensors' own limit: a longer one is not a header being written


@dataclasses.dataclass(frozen=True)
class _Shard:
    """What a safetensors file's header says of the file. `end`: the size of the whole file
    (8 + header + the data offsets' end), None while the header itself is not all written;
    `bad`: why it never will be readable (the watch lets publish refuse it and say so)."""
    size: int
    end: int | None = None
    names: frozenset = frozenset()
    bad: str | None = None


def _shard_of(head: bytes, size: int) -> _Shard:
    """A safetensors file of `size` bytes from its first bytes (at least 8 + its header's, where
    the file has them): pure, over what was read."""
    if size < 8:
        return _Shard(size)
    n = int.from_bytes(head[:8], "little")
    if n > _MAX_HEADER:
        return _Shard(size, bad=f"a header of {n:,} bytes")
    if size < 8 + n:
        return _Shard(size)
    try:
        obj = json.loads(head[8:8 + n])
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
        obj.pop("__metadata__", None)
        end = max((int(d["data_offsets"][1]) for d in obj.values()), default=0)
    except (ValueError, KeyError, TypeError, IndexError) as e:  # JSON's, UnicodeDecodeError's too
        return _Shard(size, bad=f"header: {e}")
    return _Shard(size, 8 + n + end, frozenset(obj))


def _shard_gap(name: str, s: _Shard | None) -> str | None:
    """Why shard `name` is not whole yet; None: whole (or never readable: publish says why)."""
    if s is None:
        return f"{name}: not written yet"
    if s.bad is not None:
        return None
    if s.end is None:
        return f"{name}: {s.size:,} bytes, its header not all written"
    if s.size < s.end:
        return f"{name}: {s.size:,} of {s.end:,} bytes written"
    return None  # longer than its header says: never readable, publish refuses it


def _not_whole(single: bool, shards: dict[str, _Shard], index: dict | str | None) -> str | None:
    """Why a checkpoint is not whole yet; None: whole (pure, over what was listed and read).

    `single`: a .safetensors file, `shards` then {its name: it}; else a model directory,
    `shards` its .safetensors files and `index` its model.safetensors.index.json's
    weight_map (None: none there; a str: why it does not parse yet)."""
    if single:
        ((name, s),) = shards.items()
        return _shard_gap(name, s)
    if isinstance(index, str):
        return f"{INDEX_NAME}: {index}"
    if index is not None:
        wanted: dict[str, set] = {}
        for tensor, shard in index.items():
            wanted.setdefault(shard, set()).add(tensor)
        for shard, tensors in sorted(wanted.items()):
            gap = _shard_gap(shard, shards.get(shard))
            if gap is not None:
                return gap
            s = shards[shard]
            if s.bad is None and not tensors <= s.names:
                return f"{shard}: {len(tensors - s.names)} of the tensors {INDEX_NAME} puts there are not in it"
        return None
    if not shards:
        return f"no {SUFFIX} file yet"
    if len(shards) > 1:
        return f"{len(shards)} {SUFFIX} files and no {INDEX_NAME} yet (a sharded save writes it last)"
    ((name, s),) = shards.items()
    m = _SHARD_OF.search(name)
    if m and int(m[2]) > 1:
        return f"{name}: one shard of {int(m[2])} and no {INDEX_NAME} yet"
    return _shard_gap(name, s)


def _listing(p: Path) -> tuple | None:
    """What says whether a checkpoint changed: (name, size, mtime) of the file, or of every
    file at the top of the directory (hidden ones too: a writer's temporaries); None: gone."""
    try:
        if p.is_file():
            st = p.stat()
            return ((p.name, st.st_size, st.st_mtime_ns),)
        out = []
        for f in p.iterdir():
            try:
                st = f.stat()
            except FileNotFoundError:  # renamed away meanwhile (a writer's temporary), or a dangling link
                continue
            if stat.S_ISREG(st.st_mode):
                out.append((f.name, st.st_size, st.st_mtime_ns))
        return tuple(sorted(out))
    except OSError:  # removed or renamed meanwhile
        return None


def _read_head(f: Path, size: int) -> bytes:
    with open(f, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        if n <= min(_MAX_HEADER, size - 8):
            head += fh.read(n)
        return head


def _look(p: Path, listing: tuple) -> str | None:
    """Read what `_not_whole` needs of checkpoint `p` (listed as `listing`) and ask it."""
    single = p.is_file()
    sizes = {name: size for name, size, _ in listing if name.endswith(SUFFIX)}
    index = None
    if not single and any(name == INDEX_NAME for name, _, _ in listing):
        try:
            json.loads((p / INDEX_NAME).read_bytes())
        except (ValueError, UnicodeDecodeError):
            index = "not all written"  # a partly written index does not parse: wait for it
        else:
            try:
                index = read_index(p / INDEX_NAME)
            except InvalidInput:
                return None  # a whole index that is wrong: publish refuses it and says why
    wanted = set(sizes) if index is None or isinstance(index, str) else set(index.values()) & set(sizes)
    shards = {name: _shard_of(_read_head(p if single else p / name, sizes[name]), sizes[name]) for name in wanted}
    return _not_whole(single, shards, index)


class Watch:
    """Which checkpoints of a watched directory to publish, poll by poll: those whole and
    unchanged since the previous poll. One not whole yet is looked at again (its reason logged
    once); nothing here marks it done."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.seen: dict[str, tuple] = {}  # name -> its listing at the previous poll
        self.waiting: dict[str, tuple] = {}  # name -> (listing, why it was not whole then)

    def ready(self, done: set[str]) -> list[Path]:
        """One poll: in name order, the checkpoints not in `done` that are ready to publish."""
        out = []
        entries = sorted(self.directory.iterdir(), key=_name_order) if self.directory.is_dir() else []
        names = {e.name for e in entries}
        for gone in [n for n in self.seen if n not in names]:
            self.seen.pop(gone)
            self.waiting.pop(gone, None)
        for entry in entries:
            if entry.name in done or _TEMP.search(entry.name):
                continue
            if not entry.is_dir() and entry.suffix != SUFFIX:
                continue
            listing = _listing(entry)
            before, self.seen[entry.name] = self.seen.get(entry.name), listing
            if listing is None or listing != before:
                continue  # new or changed since the previous poll: not taken while it may be mid-write
            if not any(name.endswith(SUFFIX) for name, _, _ in listing):
                continue  # a directory with no weights in it (yet): not a checkpoint (yet)
            waited = self.waiting.get(entry.name)
            if waited is not None and waited[0] == listing:
                continue  # not whole, and nothing changed since
            try:
                gap = _look(entry, listing)
            except OSError as e:
                gap = f"not readable yet ({e})"
            if gap is None and _listing(entry) != listing:
                gap = "changed while it was read"
            if gap is not None:
                if waited is None or waited[1] != gap:
                    log.info("waiting for %s: %s", entry.name, gap)
                self.waiting[entry.name] = (listing, gap)
                continue
            self.waiting.pop(entry.name, None)
            out.append(entry)
        return out
