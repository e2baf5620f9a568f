"""Checkpoints on disk: safetensors files and Hugging Face shard directories.

Owns reading a served state from disk (`load_state`; `load_model` adds a model
directory's side files: config, tokenizer...), writing one back (`save_state`)
and the atomic-replace discipline for every file the node writes
(`write_bytes_atomic`). A state is `dict[str, Tensor]`; a layout is the
Hugging Face `weight_map` (tensor name -> shard file name), None for a single
file. Tensors come back bit for bit: names, dtypes, shapes and bytes.

Must not interpret the weights (that is protocol/), and must never leave a
half-written file or directory under the name the caller asked for: writes go
to a temporary name in the same directory, then `os.replace`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from patchswarm.protocol.errors import InvalidInput, UsageError
from patchswarm.protocol.served import MAX_SIDE_FILE_BYTES, RESERVED_NAMES, check_side_file_name

State = dict[str, torch.Tensor]
Layout = dict[str, str] | None

INDEX_NAME = "model.safetensors.index.json"
SUFFIX = ".safetensors"


def load_state(path: str | os.PathLike) -> tuple[State, Layout]:
    """Read a `.safetensors` file or a directory of shards; return (state, layout).

    A directory either has `model.safetensors.index.json` (its `weight_map` is
    the layout and must match the shards' contents) or one or more
    `*.safetensors` files and no index (the layout is taken from the files).
    """
    p = Path(path)
    if not p.exists():
        raise InvalidInput(f"{p}: no such file or directory")
    if p.is_dir():
        return _load_dir(p)
    if p.suffix != SUFFIX:
        raise InvalidInput(f"{p}: expected a {SUFFIX} file or a directory of shards, found {p.suffix or 'no suffix'!r}")
    return read_tensors(p), None


# What Hugging Face Trainer (and Accelerate) write beside the model in a checkpoint-N
# directory to resume training: optimizer and scheduler state, the grad scaler, RNG
# states, the trainer's own state and arguments. Not the model: an engine never reads
# them, the optimizer's is twice the weights (past MAX_SIDE_FILE_BYTES it refused the
# whole checkpoint), and every node would fetch them again at every version. DeepSpeed's
# `latest` (the tag of its own state folder) and `zero_to_fp32.py` (its converter) too.
TRAINING_STATE = re.compile(r"(optimizer|scheduler)\.(pt|bin)|scaler\.pt|rng_state(_\d+)?\.pth"
                            r"|trainer_state\.json|training_args\.bin|latest|zero_to_fp32\.py")


def read_side_files(d: str | os.PathLike) -> dict[str, bytes]:
    """The other files of a Hugging Face model directory (config.json, tokenizer and
    generation files...): every regular, non-hidden file at its top that is not a
    shard, the shard index (the index is made again from the layout) or a trainer's
    training state (`TRAINING_STATE`)."""
    d = Path(d)
    out = {}
    for f in sorted(d.iterdir()):
        if (f.is_file() and f.suffix != SUFFIX and f.name != INDEX_NAME and not f.name.startswith(".")
                and not TRAINING_STATE.fullmatch(f.name)):
            size = f.stat().st_size
            if size > MAX_SIDE_FILE_BYTES:
                raise InvalidInput(f"{f}: a side file of {size:,} bytes; expected at most {MAX_SIDE_FILE_BYTES:,}")
            out[f.name] = f.read_bytes()
    return out


def load_model(path: str | os.PathLike) -> tuple[State, Layout, dict[str, bytes]]:
    """`load_state`, plus the side files when `path` is a model directory ({} for a file)."""
    state, layout = load_state(path)
    return state, layout, read_side_files(path) if Path(path).is_dir() else {}


def write_side_files(d: str | os.PathLike, files: dict[str, bytes]) -> None:
    """Write side files into directory `d` (each atomically)."""
    for name, data in files.items():
        write_bytes_atomic(Path(d) / check_side_file_name(name), data)


def read_tensors(path: str | os.PathLike) -> State:
    """Every tensor of one `.safetensors` file, in memory this process owns.

    A mapped tensor (safetensors maps the file copy-on-write) keeps the file's
    pages until it is written: rewriting the file in place would change the
    loaded weights (truncating it kills the process with SIGBUS), and the first
    patch applied would pay a page fault per 4 KiB it writes, while the swarm is
    still fetching. Copying once at load avoids both."""
    return read_tensors_and_metadata(path)[0]


def read_tensors_and_metadata(path: str | os.PathLike) -> tuple[State, dict[str, str]]:
    """`read_tensors` and the file's metadata, from one open of it: a file renamed over
    between two opens (a member's weights, compacted while a tool reads them) gave one
    version's metadata and another's tensors."""
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            return {name: f.get_tensor(name).clone() for name in f.keys()}, metadata  # one mapped tensor at a time
    except SafetensorError as e:
        raise InvalidInput(f"{path}: not a readable safetensors file ({e})") from None


def _load_dir(d: Path) -> tuple[State, dict[str, str]]:
    index = d / INDEX_NAME
    if index.exists():
        weight_map = read_index(index)
        state: State = {}
        for file, names in sorted(names_by_shard(weight_map).items()):
            shard = d / file
            if not shard.is_file():
                raise InvalidInput(f"{index}: names shard {file!r}, which does not exist in {d}")
            part = read_tensors(shard)
            expected = set(names)
            if set(part) != expected:
                extra, missing = sorted(set(part) - expected), sorted(expected - set(part))
                raise InvalidInput(
                    f"{shard}: index expects {len(expected)} tensors, file has {len(part)}"
                    f" (missing {missing[:3]}, unlisted {extra[:3]})"
                )
            state.update(part)
        return state, dict(sorted(weight_map.items()))
    files = sorted(f for f in d.iterdir() if f.is_file() and f.suffix == SUFFIX)
    if not files:
        raise InvalidInput(f"{d}: expected {INDEX_NAME} or *{SUFFIX} files, found neither")
    state, layout = {}, {}
    for f in files:
        for name, t in read_tensors(f).items():
            if name in layout:
                raise InvalidInput(f"{d}: tensor {name!r} is in both {layout[name]} and {f.name}")
            state[name], layout[name] = t, f.name
    return state, dict(sorted(layout.items()))


def names_by_shard(layout: dict[str, str]) -> dict[str, list[str]]:
    """{shard file: its tensors' names, in the layout's order}, in one pass over the layout
    (a pass per shard cost 4 s a load at DeepSeek-V3's 163 shards and 140k tensors)."""
    out: dict[str, list[str]] = {}
    for name, file in layout.items():
        out.setdefault(file, []).append(name)
    return out


def read_index(index: Path) -> dict[str, str]:
    try:
        obj = json.loads(index.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidInput(f"{index}: expected JSON, found undecodable text ({e})") from None
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise InvalidInput(f"{index}: expected a 'weight_map' of tensor name -> file name")
    for file in set(weight_map.values()):
        _check_shard_name(file, str(index))
    return weight_map


def _check_shard_name(file: str, where: str) -> None:
    """Shard names come from outside (an index, a patch): plain file names only."""
    if not file.endswith(SUFFIX) or file != os.path.basename(file) or file in ("", ".", "..") or "\\" in file:
        raise InvalidInput(f"{where}: shard name: expected a plain *{SUFFIX} file name, found {file!r}")


def check_destination(path: str | os.PathLike, layout: Layout) -> None:
    """Raise unless `save_state(state, path, layout)` could write there; writes nothing."""
    p = Path(path)
    if layout is None:
        if p.suffix != SUFFIX:
            raise UsageError(f"{p}: a single-file checkpoint must end with {SUFFIX}")
        if p.is_dir():
            raise UsageError(f"{p}: is a directory, expected a {SUFFIX} file name")
    else:
        for file in set(layout.values()):
            _check_shard_name(file, "layout")
        if p.exists() and not p.is_dir():
            raise UsageError(f"{p}: exists and is not a directory; a sharded checkpoint is a directory")
        if p.is_dir():
            # The directory is replaced whole: only a checkpoint's own files may be lost with it.
            others = sorted(f.name for f in p.iterdir()
                            if not (f.is_file() and (f.suffix == SUFFIX or f.name == INDEX_NAME)))
            if others:
                raise UsageError(f"{p}: expected a new path or a directory of shards and {INDEX_NAME} to replace, "
                                 f"found {len(others)} other entries in it ({others[:3]})")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{p}: parent directory {parent} does not exist")


def save_state(state: State, path: str | os.PathLike, layout: Layout = None,
               metadata: dict[str, str] | None = None, durable: bool = False) -> None:
    """Write `state` as one `.safetensors` file (layout None) or a shard directory with an index.

    Atomic: the file (or directory) appears under `path` complete or not at all.
    `metadata` goes into a single file's safetensors header; `durable` fsyncs
    the file and its directory before returning (a crash then keeps it).
    """
    check_destination(path, layout)
    p = Path(path)
    tensors = _savable(state)
    if layout is None:
        _save_file_atomic(tensors, p, {"format": "pt", **(metadata or {})}, durable)
        return
    if metadata:
        raise UsageError("save_state: metadata is only supported for a single file")
    missing = sorted(set(tensors) - set(layout))
    if missing:
        raise UsageError(f"layout: names no shard for tensors {missing[:3]} ({len(missing)} in all)")
    weight_map = {n: layout[n] for n in sorted(tensors)}
    tmp = Path(tempfile.mkdtemp(prefix=p.name + ".tmp-", dir=p.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        for file, names in sorted(names_by_shard(weight_map).items()):
            shard = {n: tensors[n] for n in names}
            save_file(shard, str(tmp / file), metadata={"format": "pt"})
            os.chmod(tmp / file, 0o666 & ~_umask())
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        _replace_dir(tmp, p)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_tensor_name(name: str) -> None:
    """UsageError for a name no safetensors file can hold: its header keeps the file's
    metadata under RESERVED_NAMES ('__metadata__'); a tensor of that name made a file that
    no reader takes."""
    if name in RESERVED_NAMES:
        raise UsageError(f"state: tensor {name!r}: expected a name other than safetensors' metadata key")


def _savable(state: State) -> State:
    """Contiguous CPU tensors, none sharing storage (safetensors refuses shared memory)."""
    out, seen = {}, set()
    for name, t in state.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise UsageError(f"state: expected dict[str, torch.Tensor], found entry {name!r}: {type(t).__name__}")
        check_tensor_name(name)
        t = t.detach().cpu().contiguous()
        if t.numel() > 0:
            key = t.untyped_storage().data_ptr()
            if key in seen:
                t = t.clone()
                key = t.untyped_storage().data_ptr()
            seen.add(key)
        out[name] = t
    return out


def _save_file_atomic(tensors: State, p: Path, metadata: dict[str, str], durable: bool) -> None:
    fd, tmp = tempfile.mkstemp(prefix=p.name + ".tmp-", dir=p.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)  # may recreate the file: chmod after
        os.chmod(tmp, 0o666 & ~_umask())
        if durable:
            fsync_path(tmp)
        os.replace(tmp, p)
        if durable:
            fsync_path(p.parent)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory by its path (a directory: so a rename in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(tmp: Path, p: Path) -> None:
    """Move directory `tmp` to `p`; an existing `p` is moved aside first, then removed."""
    if not p.exists():
        os.rename(tmp, p)
        return
    old = Path(tempfile.mkdtemp(prefix=p.name + ".old-", dir=p.parent))
    os.rmdir(old)
    os.rename(p, old)
    try:
        os.rename(tmp, p)
    except BaseException:
        os.rename(old, p)
        raise
    if old.is_symlink():  # `p` was a link to a directory: the link goes, not what it points to
        old.unlink()
    else:
        shutil.rmtree(old, ignore_errors=True)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` via a temporary file in the same directory and `os.replace`."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=p.name + ".tmp-", dir=p.parent if str(p.parent) else ".")
    try:
        os.chmod(tmp, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _umask() -> int:
    """The process umask (mkstemp/mkdtemp create private files; the result should not be)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
