"""Trajectory bytes from elsewhere (a node's upload batch, a spool entry) are bounded before they are built."""

from __future__ import annotations

import struct
import zlib

import lz4.block
import msgpack
import pytest

from patchswarm.protocol import trajectory as T
from patchswarm.protocol.errors import CorruptData
from memory import traced_peak

HEADER = struct.Struct("<4sBBII")


def batch_of(raw: bytes, compress: bool = True, raw_len: int | None = None) -> bytes:
    data = lz4.block.compress(raw, store_size=False) if compress else raw
    return HEADER.pack(b"PSTB", 1, 1 if compress else 0, len(raw) if raw_len is None else raw_len, zlib.crc32(raw)) + data


def record_body(meta) -> bytes:
    return msgpack.packb([T.KIND_RECORD, "n1", "eu", 1, 2, 1.5, b"payload", meta])


def test_a_batch_header_is_checked_against_lz4_s_ratio_before_it_is_allocated():
    lie = batch_of(msgpack.packb([]), raw_len=T.MAX_BATCH_BYTES)  # 12 MiB declared for a few bytes

    def decode():
        with pytest.raises(CorruptData, match="raw bytes per lz4 byte"):
            T.decode_batch(lie)

    assert traced_peak(decode) < 1 << 20


def test_a_batch_of_nested_arrays_costs_nothing_to_refuse():
    n = 4 << 20
    raw = b"\x91\xdd" + n.to_bytes(4, "big") + b"\x90" * n  # 4 MiB: one record of 4 M empty arrays
    data = batch_of(raw)

    def decode():
        with pytest.raises(CorruptData, match="batch record 0"):
            T.decode_batch(data)

    # lz4 peaks at twice the decompressed bytes; unpacking the arrays would cost ~250 MB
    assert traced_peak(decode) < 2 * len(raw) + (1 << 20)


def test_meta_maps_are_bounded_in_depth_and_size_when_decoded():
    deep = {}
    for _ in range(T.MAX_META_DEPTH + 5):
        deep = {"k": deep}
    with pytest.raises(CorruptData, match="nested at most"):
        T.decode_record(record_body(deep))
    with pytest.raises(CorruptData, match="nested at most"):
        T.decode_batch(batch_of(b"\x91" + record_body(deep)))
    big = {"x": b"\0" * (T.MAX_META_BYTES + 1)}
    with pytest.raises(CorruptData, match=f"at most {T.MAX_META_BYTES} bytes"):
        T.decode_record(record_body(big))
    ok = {"env": "cartpole", 3: [1.5, None, {"a": b"x"}]}  # any key msgpack packs
    assert T.decode_record(record_body(ok)).meta == ok


def test_every_entry_kind_still_decodes():
    values = [
        T.Record("n1", "eu", 7, 3, 1.25, b"p", {"a": 1}),
        T.Record("n1", "eu", 2**64 - 1, 0, 0.0, b"", None),
        T.ReceivedRecord("n1", "eu", 7, 3, 1.25, b"p", None, received_at=9.5),
        T.DuplicatesNote(4),
        T.SpoolState("n1", "eu", 100),
        T.AckedRanges([(0, 5), (9, 2**64 - 1)]),
    ]
    for v in values:
        assert T.decode_record(T.encode_record(v)) == v
    assert T.decode_batch(T.encode_batch(values[:2])) == values[:2]


def test_a_batch_the_origin_takes_in_holds_its_meta_as_the_bytes_it_came_in():
    """Before: decode_batch built every record's meta as Python objects, and a meta of
    64 KiB of empty arrays is 65,000 lists (~4.5 MB): one 50 KB upload of 193 such records
    held 849 MiB in the origin (measured) until the store took it. The origin only
    stores meta again, so `decode_batch(data, packed_meta=True)` checks each meta (it is
    built once and let go) and keeps its bytes: the batch holds about its raw size, the
    store writes the same bytes, and what a reader decodes from them is the same meta."""
    meta = {"a": [[] for _ in range(64000)]}
    recs = [T.Record("n1", "eu", i, 2, 1.5, b"p", meta) for i in range(6)]
    data = T.encode_batch(recs)
    held = []
    peak = traced_peak(lambda: held.append(T.decode_batch(data, packed_meta=True)))
    assert peak < 12 << 20  # one meta's objects at a time; all 6 of them: ~25 MB
    got = held[0]
    assert [type(r.meta) for r in got] == [T.PackedMeta] * 6
    body = b"".join(T.received_parts(got[3], 9.5))
    assert T.decode_record(body) == recs[3].received(9.5)
    assert T.decode_batch(data) == recs  # the default still builds it
    bad = record_body({"k": b"x"}).replace(b"\xa1k", b"\xa1\xff")  # a key that is not UTF-8
    with pytest.raises(CorruptData, match="meta"):
        T.decode_batch(batch_of(b"\x91" + bad), packed_meta=True)
