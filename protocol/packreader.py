"""Reading msgpack of an expected shape, every size bounded before anything is built. Sans-IO.

Owns `PackReader`, a cursor over msgpack bytes. Each method reads one value of
the kind the caller expects (a map or array header, str, bin, int, bool, nil,
float) and raises the caller's error class, saying what was expected and what
was found, when the next value is of another kind, when a length it declares
exceeds the caller's limit or the bytes left, or when the data ends. Containers
are never built here: the caller reads a header, checks the count against what
its schema allows, then reads the members. `skip` walks one value of any kind
without building it, with its nesting depth and number of values bounded, so a
caller can hand a free-form value (a trajectory's meta map) to msgpack once it
knows what unpacking it costs. `any` checks a free-form value (bounded, no ext
type, UTF-8 strs, hashable keys) with protocol/_kernels.c's `check_msgpack`
where it built, with `skip` and msgpack otherwise (`check_value`, the
reference), and builds it only when asked.

Why: `msgpack.unpackb` builds every container before any check can run, and a
container costs ~70 bytes of Python per byte of msgpack (0x90 is an empty
array): 16 MiB of nested empty arrays became ~1.2 GB before the first field was
looked at. Reading along a schema costs memory in proportion to the fields the
schema allows, never to what the bytes declare or nest.

Must not: do I/O, or accept what the msgpack spec does not define (ext types
and the reserved byte 0xc1 are refused by every reader).
"""

from __future__ import annotations

import struct

import msgpack

from .errors import InvalidInput

try:  # the compiled check of `any` (setup.py: optional); `check_value` is its twin and reference
    from . import _kernels as KERNEL
except ImportError:  # pragma: no cover - exercised where the compiler is missing
    KERNEL = None

MAX_SKIP_DEPTH = 32  # `skip`: containers inside containers, by default
KERNEL_MAX_DEPTH = 64  # the deepest nesting the compiled check takes (its stack); deeper limits use `skip`

_U16, _U32, _U64 = struct.Struct(">H"), struct.Struct(">I"), struct.Struct(">Q")
_I8, _I16, _I32, _I64 = struct.Struct(">b"), struct.Struct(">h"), struct.Struct(">i"), struct.Struct(">q")
_F32, _F64 = struct.Struct(">f"), struct.Struct(">d")
# int formats (uint 8..64, int 8..64): first byte -> (struct, size)
_INTS = {0xcc: (None, 1), 0xcd: (_U16, 2), 0xce: (_U32, 4), 0xcf: (_U64, 8),
         0xd0: (_I8, 1), 0xd1: (_I16, 2), 0xd2: (_I32, 4), 0xd3: (_I64, 8)}
# bytes after the first of fixed-size values, for `skip`
_FIXED = {0xc0: 0, 0xc2: 0, 0xc3: 0, 0xca: 4, 0xcb: 8, **{b: n for b, (_, n) in _INTS.items()}}
_STR_LEN = {0xd9: 1, 0xda: 2, 0xdb: 4}
_BIN_LEN = {0xc4: 1, 0xc5: 2, 0xc6: 4}
_ARRAY_LEN = {0xdc: 2, 0xdd: 4}
_MAP_LEN = {0xde: 2, 0xdf: 4}


def kind_of(byte: int) -> str:
    """The msgpack kind a value starting with this byte has, in words."""
    if byte <= 0x7f or byte >= 0xe0 or byte in _INTS:
        return "int"
    if byte <= 0x8f or byte in _MAP_LEN:
        return "map"
    if byte <= 0x9f or byte in _ARRAY_LEN:
        return "array"
    if byte <= 0xbf or byte in _STR_LEN:
        return "str"
    if byte in _BIN_LEN:
        return "bin"
    return {0xc0: "nil", 0xc2: "bool", 0xc3: "bool", 0xca: "float", 0xcb: "float"}.get(byte, "ext or reserved")


class PackReader:
    """A cursor over `data`; see the module docstring.

    `error` is the class raised for bad input (ProtocolError on the wire,
    CorruptData for files), `what` names the input in messages.
    """

    __slots__ = ("data", "pos", "end", "error", "what")

    def __init__(self, data: bytes, error: type[InvalidInput], what: str, start: int = 0, end: int | None = None):
        self.data = data
        self.pos = start
        self.end = len(data) if end is None else end
        self.error = error
        self.what = what

    # ---------------------------------------------------------------- errors

    def fail(self, expected: str, found: str) -> InvalidInput:
        return self.error(f"{self.what}: expected {expected}, found {found} at byte {self.pos}")

    def _first(self, expected: str) -> int:
        if self.pos >= self.end:
            raise self.fail(expected, "the end of the data")
        return self.data[self.pos]

    def _length(self, size: int, expected: str) -> int:
        """The big-endian length of `size` bytes after the first byte; moves past them."""
        at = self.pos + 1
        if at + size > self.end:
            raise self.fail(expected, "the end of the data")
        self.pos = at + size
        return int.from_bytes(self.data[at:at + size], "big")

    def _room(self, n: int, limit: int, expected: str) -> None:
        if n > limit:
            raise self.fail(f"{expected} of at most {limit} bytes", f"a length of {n}")
        if n > self.end - self.pos:
            raise self.fail(expected, f"a length of {n} with {self.end - self.pos} bytes left")

    # ---------------------------------------------------------------- values

    def peek_kind(self) -> str:
        return kind_of(self._first("a value"))

    def at_end(self) -> bool:
        return self.pos >= self.end

    def expect_end(self) -> None:
        if self.pos != self.end:
            raise self.fail("nothing more", f"{self.end - self.pos} more bytes")

    # Each reader starts with a fast path for the usual short form (fixmap, fixarray,
    # fixstr, fixint, bin8): a method call and a few comparisons; anything else,
    # errors included, takes the general path below it.

    def map_len(self, limit: int, expected: str = "a map") -> int:
        """A map header of at most `limit` entries (each entry at least 2 bytes follows)."""
        return self._header(0x80, _MAP_LEN, 2, limit, expected, ("entries", "a map header"))

    def array_len(self, limit: int, expected: str = "an array") -> int:
        """An array header of at most `limit` elements (each at least a byte follows)."""
        return self._header(0x90, _ARRAY_LEN, 1, limit, expected, ("elements", "an array header"))

    def _header(self, fix: int, lengths: dict, item_bytes: int, limit: int, expected: str, words) -> int:
        """A container header: its fix form (`fix` + n), else a long one (`lengths`); n at
        most `limit`, with at least `item_bytes` bytes left per item."""
        pos = self.pos
        if pos < self.end:  # the fix form, inline: most headers are
            b = self.data[pos]
            if fix <= b <= fix + 0x0f and b - fix <= limit and item_bytes * (b - fix) < self.end - pos:
                self.pos = pos + 1
                return b - fix
        b = self._first(expected)
        if fix <= b <= fix + 0x0f:
            self.pos += 1
            n = b & 0x0f
        elif b in lengths:
            n = self._length(lengths[b], expected)
        else:
            raise self.fail(expected, kind_of(b))
        if n > limit or item_bytes * n > self.end - self.pos:
            raise self.fail(f"{expected} of at most {limit} {words[0]}", f"{words[1]} of {n} with {self.end - self.pos} bytes left")
        return n

    def str(self, limit: int, expected: str = "a str") -> str:
        """A UTF-8 str of at most `limit` bytes."""
        pos = self.pos
        if pos < self.end:
            b = self.data[pos]
            if 0xa0 <= b <= 0xbf:
                start, n = pos + 1, b - 0xa0
            elif b == 0xd9 and pos + 1 < self.end:  # str8: names of 32 to 255 bytes
                start, n = pos + 2, self.data[pos + 1]
            else:
                start = n = -1
            if start > 0 and n <= limit and start + n <= self.end:
                try:
                    text = str(self.data[start:start + n], "utf-8")
                except UnicodeDecodeError:
                    pass  # the general path says so
                else:
                    self.pos = start + n
                    return text
        b = self._first(expected)
        if 0xa0 <= b <= 0xbf:
            self.pos += 1
            n = b & 0x1f
        elif b in _STR_LEN:
            n = self._length(_STR_LEN[b], expected)
        else:
            raise self.fail(expected, kind_of(b))
        self._room(n, limit, expected)
        at = self.pos
        self.pos += n
        try:
            return str(self.data[at:at + n], "utf-8")
        except UnicodeDecodeError:
            self.pos = at
            raise self.fail(expected, "bytes that are not UTF-8") from None

    def bin(self, limit: int, expected: str = "bytes") -> bytes:
        """A bin of at most `limit` bytes (a copy)."""
        at, n = self._bin_span(limit, expected)
        data = self.data
        if type(data) is bytes:
            return data[at:at + n]
        with memoryview(data) as view:  # one copy, not a bytearray slice and then bytes
            return bytes(view[at:at + n])

    def bin_view(self, limit: int, expected: str = "bytes") -> memoryview:
        """A bin of at most `limit` bytes as a read-only view into the data (no copy: it keeps
        the data alive, and sees it change if it is a bytearray that is written to)."""
        at, n = self._bin_span(limit, expected)
        return memoryview(self.data).toreadonly()[at:at + n]

    def _bin_span(self, limit: int, expected: str) -> tuple[int, int]:
        """Where the next value's bytes start and how many, once it is checked to be a bin of
        at most `limit` bytes within the data; the cursor moves past it."""
        pos, data = self.pos, self.data
        if pos + 1 < self.end:
            b = data[pos]
            if b == 0xc4:
                start, n = pos + 2, data[pos + 1]
            elif b == 0xc5 and pos + 2 < self.end:
                start, n = pos + 3, (data[pos + 1] << 8) | data[pos + 2]
            else:
                start = n = -1
            if start > 0 and n <= limit and start + n <= self.end:
                self.pos = start + n
                return start, n
        b = self._first(expected)
        if b not in _BIN_LEN:
            raise self.fail(expected, kind_of(b))
        n = self._length(_BIN_LEN[b], expected)
        self._room(n, limit, expected)
        at = self.pos
        self.pos += n
        return at, n

    def int(self, lo: int = -(1 << 63), hi: int = (1 << 64) - 1, expected: str = "an int") -> int:
        """An int in [lo, hi], in any of msgpack's int formats."""
        start, data = self.pos, self.data
        if start < self.end:
            b = data[start]
            if b <= 0x7f and lo <= b <= hi:
                self.pos = start + 1
                return b
            if b == 0xce and start + 5 <= self.end:  # uint32: seqs, sizes
                v = int.from_bytes(data[start + 1:start + 5], "big")
                if lo <= v <= hi:
                    self.pos = start + 5
                    return v
        b = self._first(expected)
        if b <= 0x7f:
            self.pos += 1
            v = b
        elif b >= 0xe0:
            self.pos += 1
            v = b - 0x100
        elif b in _INTS:
            fmt, size = _INTS[b]
            if self.pos + 1 + size > self.end:
                raise self.fail(expected, "the end of the data")
            v = self.data[self.pos + 1] if fmt is None else fmt.unpack_from(self.data, self.pos + 1)[0]
            self.pos += 1 + size
        else:
            raise self.fail(expected, kind_of(b))
        if not lo <= v <= hi:
            self.pos = start
            raise self.fail(f"{expected} in [{lo}, {hi}]", str(v))
        return v

    def uint(self, limit: int = (1 << 64) - 1, expected: str = "a non-negative int") -> int:
        """An int in [0, limit]."""
        pos = self.pos
        if pos < self.end:
            b = self.data[pos]
            if b <= 0x7f and b <= limit:
                self.pos = pos + 1
                return b
        return self.int(0, limit, expected)

    def uints(self, count: int, limit: int = (1 << 64) - 1, expected: str = "a non-negative int") -> list[int]:
        """`count` ints in [0, limit] one after another (one call: class tables,
        shapes and piece lists hold many, in the short unsigned forms)."""
        data, pos, end = self.data, self.pos, self.end
        out = []
        for _ in range(count):
            b = data[pos] if pos < end else -1
            if 0 <= b <= 0x7f:
                v, pos = b, pos + 1
            elif b == 0xcd and pos + 3 <= end:
                v, pos = (data[pos + 1] << 8) | data[pos + 2], pos + 3
            elif b == 0xce and pos + 5 <= end:
                v, pos = int.from_bytes(data[pos + 1:pos + 5], "big"), pos + 5
            elif b == 0xcc and pos + 2 <= end:
                v, pos = data[pos + 1], pos + 2
            else:
                self.pos = pos
                v = self.int(0, limit, expected)
                pos = self.pos
            if v > limit:
                self.pos = pos
                raise self.fail(f"{expected} in [0, {limit}]", str(v))
            out.append(v)
        self.pos = pos
        return out

    def uint_tuples(self, count: int, width: int, limit: int, expected: str) -> list[tuple[int, ...]]:
        """`count` arrays of exactly `width` ints in [0, limit] each (a segment's pieces)."""
        data, end = self.data, self.end
        head = 0x90 + width
        out = []
        for _ in range(count):
            pos = self.pos
            if pos < end and data[pos] == head:
                pos += 1
            else:  # another form of the header, or not an array of `width`
                if self.array_len(width, expected) != width:
                    self.pos = pos
                    raise self.fail(expected, "an array of another length")
                pos = self.pos
            row = []
            for _ in range(width):  # `uints`, inline: pieces are most of a small chunk's fields
                b = data[pos] if pos < end else -1
                if 0 <= b <= 0x7f:
                    v, pos = b, pos + 1
                elif b == 0xcd and pos + 3 <= end:
                    v, pos = (data[pos + 1] << 8) | data[pos + 2], pos + 3
                elif b == 0xce and pos + 5 <= end:
                    v, pos = int.from_bytes(data[pos + 1:pos + 5], "big"), pos + 5
                else:
                    self.pos = pos
                    v = self.int(0, limit, expected)
                    pos = self.pos
                if v > limit:
                    self.pos = pos
                    raise self.fail(f"{expected} in [0, {limit}]", str(v))
                row.append(v)
            self.pos = pos
            out.append(tuple(row))
        return out

    def bool(self, expected: str = "a bool") -> bool:
        b = self._first(expected)
        if b not in (0xc2, 0xc3):
            raise self.fail(expected, kind_of(b))
        self.pos += 1
        return b == 0xc3

    def nil(self) -> bool:
        """Move past a nil and say True, or say False and stay."""
        if self.pos < self.end and self.data[self.pos] == 0xc0:
            self.pos += 1
            return True
        return False

    def float(self, expected: str = "a float") -> float:
        """A float32 or float64 (not an int)."""
        b = self._first(expected)
        fmt = _F32 if b == 0xca else _F64 if b == 0xcb else None
        if fmt is None:
            raise self.fail(expected, kind_of(b))
        if self.pos + 1 + fmt.size > self.end:
            raise self.fail(expected, "the end of the data")
        v = fmt.unpack_from(self.data, self.pos + 1)[0]
        self.pos += 1 + fmt.size
        return v

    def number(self, expected: str = "a number") -> int | float:
        """An int or a float."""
        return self.float(expected) if self.peek_kind() == "float" else self.int(expected=expected)

    # ---------------------------------------------------------------- free-form values

    def skip(self, max_values: int, max_depth: int = MAX_SKIP_DEPTH, expected: str = "a value") -> int:
        """Move past one value of any kind (no ext) without building it; returns how
        many values it holds, itself included. Raises when it holds more than
        `max_values` values or nests containers deeper than `max_depth`."""
        data, pos, end = self.data, self.pos, self.end
        outer: list[int] = []  # values still to read in each enclosing container
        left = 1  # values still to read in the innermost open one
        count = 0
        while True:
            if not left:
                if not outer:
                    break
                left = outer.pop()
                continue
            left -= 1
            if pos >= end:
                self.pos = pos
                raise self.fail(expected, "the end of the data")
            b = data[pos]
            count += 1
            if count > max_values:
                self.pos = pos
                raise self.fail(f"{expected} of at most {max_values} values", "more")
            if b <= 0x7f or b >= 0xe0:  # fixint
                pos += 1
            elif 0xa0 <= b <= 0xbf:  # fixstr
                pos += 1 + (b & 0x1f)
            elif b in _FIXED:
                pos += 1 + _FIXED[b]
            else:
                if 0x80 <= b <= 0x8f:
                    n, pos = 2 * (b & 0x0f), pos + 1
                elif 0x90 <= b <= 0x9f:
                    n, pos = b & 0x0f, pos + 1
                else:
                    size = _STR_LEN.get(b) or _BIN_LEN.get(b) or _ARRAY_LEN.get(b) or _MAP_LEN.get(b)
                    if size is None:
                        self.pos = pos
                        raise self.fail(expected, kind_of(b))
                    length = int.from_bytes(data[pos + 1:pos + 1 + size], "big")
                    pos += 1 + size
                    if b in _ARRAY_LEN:
                        n = length
                    elif b in _MAP_LEN:
                        n = 2 * length
                    else:
                        n, pos = 0, pos + length
                if n:
                    if len(outer) >= max_depth:
                        self.pos = pos
                        raise self.fail(f"{expected} nested at most {max_depth} deep", "deeper")
                    if n > end - pos:
                        self.pos = pos
                        raise self.fail(expected, f"a container of {n} values with {end - pos} bytes left")
                    outer.append(left)
                    left = n
        if pos > end:
            raise self.fail(expected, "the end of the data")
        self.pos = pos
        return count

    def any(self, max_values: int, max_depth: int = MAX_SKIP_DEPTH, expected: str = "a value",
            max_bytes: int | None = None, kind: str | None = None, build: bool = True):
        """One free-form value, unpacked by msgpack once it is known to be bounded (by
        `max_values` and `max_depth`; its size by `max_bytes`, its kind by `kind`) and
        to unpack. Map keys may be any hashable msgpack value. `build=False` checks the
        same and returns None (a caller that keeps the bytes as they are).

        The check: the compiled `check_msgpack` where it built and the limits allow,
        else (and whenever it refuses, so the message is the reference's) `skip`,
        then msgpack. Why: `skip` walks a byte at a time in Python, and a batch of
        metas made of empty arrays (12 MiB raw, ~55 KB after lz4) cost the origin
        ~3 s of CPU; compiled it is ~0.3 ms per 64 KiB meta and builds nothing."""
        start = self.pos
        if kind is not None and kind_of(self._first(expected)) != kind:
            raise self.fail(expected, kind_of(self.data[start]))
        if KERNEL is not None and max_depth <= KERNEL_MAX_DEPTH:
            stop = KERNEL.check_msgpack(self.data, start, self.end, max_values, max_depth)
            if stop >= 0 and (max_bytes is None or stop - start <= max_bytes):
                self.pos = stop
                return self._unpack(start, expected) if build else None
            # refused: the reference below says what it expected and found
        self.skip(max_values, max_depth, expected)
        size = self.pos - start
        if max_bytes is not None and size > max_bytes:
            self.pos = start
            raise self.fail(f"{expected} of at most {max_bytes} bytes", f"{size}")
        value = self._unpack(start, expected)  # the reference's check of what unpacks: built, then let go
        return value if build else None

    def _unpack(self, start: int, expected: str):
        try:
            return msgpack.unpackb(self.data[start:self.pos], raw=False, use_list=True, strict_map_key=False)
        except Exception as e:  # msgpack raises several types (unhashable key, bad UTF-8, ...)
            self.pos = start
            raise self.fail(expected, f"undecodable msgpack ({type(e).__name__}: {e})") from None


def check_value(data, start: int, end: int, max_values: int, max_depth: int = MAX_SKIP_DEPTH) -> int:
    """The Python twin of the compiled `check_msgpack` and its reference: the end of
    the one msgpack value at data[start:] (within data[:end]) that `skip` bounds by
    `max_values` and `max_depth` and msgpack unpacks (no ext type, UTF-8 strs,
    hashable map keys), or -1."""
    r = PackReader(data, InvalidInput, "value", start, end)
    try:
        r.skip(max_values, max_depth)
        r._unpack(start, "a value")
    except InvalidInput:
        return -1
    return r.pos
