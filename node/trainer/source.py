"""One publish's input, served tensor by tensor: the trainer's state_dict, or a checkpoint on disk.

Owns the served table of a version before any tensor is made (names, dtypes,
shapes, from the trainer's tensors or from the checkpoint's safetensors
headers), and `produce(name)`, which makes one served tensor when the encoder
reaches it (protocol/served.py decides what it becomes). A checkpoint is read
one tensor at a time from its files, so publishing from disk never holds the
trainer's whole state. A quantized weight and its scale are made together;
the one asked for second is kept until it is asked for.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from patchswarm.node import basefile
from patchswarm.node.checkpoint import INDEX_NAME, SUFFIX, read_index, read_side_files
from patchswarm.protocol.errors import InvalidInput, UsageError
from patchswarm.protocol.served import (FILE_PREFIX, SCALE_SUFFIX, check_format, check_source_tensor, file_tensor,
                                        file_tensor_name, serve_tensor, served_table)

Table = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def _open(path: Path):
    """safe_open(path), with what safetensors refuses as InvalidInput (the origin's watch skips it)."""
    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as e:
        raise InvalidInput(f"{path}: not a readable safetensors file ({e})") from None


class Source:
    """Make with `from_state` or `from_path`; then `table`, `layout` and `produce`."""

    def __init__(self, fmt: str, table: Table, read, layout: dict[str, str] | None, files: dict[str, bytes]):
        self.fmt = check_format(fmt)
        self._read = read  # trainer name -> its tensor
        self._origin_of: dict[str, str] = {}  # served name -> the trainer's tensor it comes from
        for name in table:
            self._origin_of[name] = name
        for name in table:
            self._origin_of.setdefault(name + SCALE_SUFFIX, name)  # fp8-block's scale of `name`
        self.table = served_table(table, fmt)
        self._files = files
        for fname, data in files.items():
            self.table[file_tensor_name(fname)] = (torch.uint8, (len(data),))
        self.layout = None
        if layout is not None:
            # A quantized weight's scale goes into its weight's shard; side files are not shards.
            self.layout = {n: layout[self._origin_of[n]] for n in self.table if not n.startswith(FILE_PREFIX)}
        self._kept: dict[str, torch.Tensor] = {}

    @classmethod
    def from_state(cls, state_dict: dict, fmt: str, files: dict[str, bytes] | None = None) -> "Source":
        if not isinstance(state_dict, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                       for k, v in state_dict.items()):
            raise UsageError("publish: expected a dict[str, torch.Tensor] (a model's state_dict) or a checkpoint path")
        for name, t in state_dict.items():
            check_source_tensor(name, t)
        table = {n: (t.dtype, tuple(t.shape)) for n, t in state_dict.items()}
        return cls(fmt, table, state_dict.__getitem__, None, files or {})

    @classmethod
    def from_path(cls, path: str | os.PathLike, fmt: str) -> "Source":
        """A .safetensors file or a Hugging Face model directory, read lazily."""
        p = Path(path)
        if not p.exists():
            raise InvalidInput(f"{p}: no such file or directory")
        if p.is_file():
            if p.suffix != SUFFIX:
                raise InvalidInput(f"{p}: expected a {SUFFIX} file or a model directory")
            files_of = {p: None}
            layout = None
            side = {}
        else:
            index = p / INDEX_NAME
            if index.exists():
                weight_map = read_index(index)
                shards = sorted(set(weight_map.values()))
            else:
                shards = sorted(f.name for f in p.iterdir() if f.is_file() and f.suffix == SUFFIX)
                if not shards:
                    raise InvalidInput(f"{p}: expected {INDEX_NAME} or *{SUFFIX} files, found neither")
                weight_map = None
            files_of = {p / s: s for s in shards}
            side = read_side_files(p)
            layout = {}
        table: Table = {}
        where: dict[str, Path] = {}
        for f, shard in files_of.items():
            if not f.is_file():
                raise InvalidInput(f"{p}: the index names shard {shard!r}, which does not exist")
            _, entries, _ = basefile.read_header(f)
            with _open(f):  # what safetensors refuses (holes, overlaps): refused before any work
                pass
            for e in entries:
                if e.name in table:
                    raise InvalidInput(f"{p}: tensor {e.name!r} is in both {where[e.name].name} and {f.name}")
                table[e.name], where[e.name] = (e.dtype, e.shape), f
                if layout is not None:
                    layout[e.name] = shard
        if layout is not None and weight_map is not None and weight_map != layout:
            raise InvalidInput(f"{p}: {INDEX_NAME} does not match the shards' contents")

        # One open file per shard for the whole publish: each open reads the file's whole
        # header, so opening it again per tensor cost O(tensors^2) (8,000 tensors in one
        # file took 70 s). The files are mapped, not read: nothing is held but the headers.
        opened: dict[Path, object] = {}

        def read(name: str) -> torch.Tensor:
            f = opened.get(where[name])
            if f is None:
                f = opened[where[name]] = _open(where[name])
            try:
                return f.get_tensor(name)
            except SafetensorError as e:
                raise InvalidInput(f"{where[name]}: tensor {name!r}: not readable ({e})") from None

        return cls(fmt, table, read, layout, side)

    def produce(self, name: str) -> torch.Tensor:
        """The served tensor `name` (each one once)."""
        kept = self._kept.pop(name, None)
        if kept is not None:
            return kept
        if name.startswith(FILE_PREFIX):
            return file_tensor(self._files[name[len(FILE_PREFIX):]])
        source = self._origin_of.get(name)
        if source is None or name not in self.table:
            raise UsageError(f"produce: {name!r} is not in this version's table")
        made = None
        for served_name, t in serve_tensor(source, self._read(source), self.fmt):
            if served_name == name:
                made = t
            else:
                self._kept[served_name] = t
        if made is None:
            raise UsageError(f"produce: {name!r} is not what {source!r} serves as")
        return made
