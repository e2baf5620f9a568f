"""The compiled msgpack check (protocol/_kernels.c `check_msgpack`) against its Python
twin and reference (packreader.check_value: `skip`'s walk, then msgpack): the same
accept/reject and the same end on random and adversarial bytes; `PackReader.any`
gives the same value or the same error either way; and the origin's check of an
adversarial batch takes the compiled path, building nothing.

The compiled module is optional (setup.py): the kernel-vs-twin tests skip where it did
not build, and `any` then runs on the reference alone.
"""

from __future__ import annotations


import hypothesis.strategies as st
import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings

from patchswarm.protocol import packreader
from patchswarm.protocol import trajectory as T
from patchswarm.protocol.errors import CorruptData
from patchswarm.protocol.packreader import PackReader, check_value

KERNEL = packreader.KERNEL
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="protocol._kernels did not build (no C compiler?)")

# strs that Python's strict UTF-8 codec refuses or takes at the edges of each rule
UTF8_EDGES = [b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xed\x9f\xbf", b"\xee\x80\x80", b"\xc0\x80", b"\xc1\xbf", b"\xc2\x80",
              b"\xe0\x80\x80", b"\xe0\x9f\xbf", b"\xe0\xa0\x80", b"\xf0\x8f\xbf\xbf", b"\xf0\x90\x80\x80",
              b"\xf4\x8f\xbf\xbf", b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xff", b"\x80", b"\xe2\x82",
              b"\xe2\x82\xac", b"\xf0\x9f\x98", b"\xf0\x9f\x98\x80", b"\xe2\x28\xa1", b"abcdefgh\xe2\x82\xacabcdefghi"]


def _str(body: bytes) -> bytes:
    n = len(body)
    return bytes([0xa0 | n]) + body if n < 32 else b"\xd9" + bytes([n]) + body


def _tokens():
    count = st.integers(0, 20)
    return st.one_of(
        st.integers(0, 0x7f).map(lambda b: bytes([b])), st.integers(0xe0, 0xff).map(lambda b: bytes([b])),
        st.sampled_from([b"\xc0", b"\xc2", b"\xc3", b"\xc1"]),  # nil, bools, the reserved byte
        st.tuples(st.sampled_from([0xca, 0xcb, 0xcc, 0xcd, 0xce, 0xcf, 0xd0, 0xd1, 0xd2, 0xd3]),
                  st.binary(min_size=0, max_size=9)).map(lambda t: bytes([t[0]]) + t[1]),  # numbers, maybe short
        st.sampled_from(UTF8_EDGES).map(_str), st.binary(max_size=40).map(_str),
        st.text(max_size=12).map(lambda s: _str(s.encode())),
        st.tuples(st.sampled_from([0xc4, 0xc5, 0xc6, 0xd9, 0xda, 0xdb]), st.integers(0, 6), st.binary(max_size=6))
          .map(lambda t: bytes([t[0]]) + t[1].to_bytes({0xc4: 1, 0xd9: 1, 0xc5: 2, 0xda: 2}.get(t[0], 4), "big") + t[2]),
        count.map(lambda n: bytes([0x90 | min(n, 15)])), count.map(lambda n: bytes([0x80 | min(n, 15)])),
        count.map(lambda n: b"\xdc" + n.to_bytes(2, "big")), count.map(lambda n: b"\xdd" + n.to_bytes(4, "big")),
        count.map(lambda n: b"\xde" + n.to_bytes(2, "big")), count.map(lambda n: b"\xdf" + n.to_bytes(4, "big")),
        st.sampled_from([b"\xdc\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdd\x00", b"\xde"]),  # huge or cut headers
        st.tuples(st.sampled_from([0xc7, 0xc8, 0xc9, 0xd4, 0xd5, 0xd6, 0xd7, 0xd8]), st.binary(max_size=4))
          .map(lambda t: bytes([t[0]]) + t[1]),  # ext types
        st.integers(0, 40).map(lambda d: b"\x91" * d), st.integers(0, 40).map(lambda d: b"\x81\x00" * d),  # nesting
    )


ADVERSARIAL = st.lists(_tokens(), max_size=30).map(b"".join)
SCALARS = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
           | st.text(max_size=20) | st.binary(max_size=20))
VALUES = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=5)
                      | st.dictionaries(st.one_of(SCALARS, st.tuples(SCALARS)), kids, max_size=5), max_leaves=30)


def _packed_and_mutated(value, at, byte, cut):
    data = bytearray(msgpack.packb(value, use_bin_type=True))
    if data and at is not None:
        data[at % len(data)] = byte
    return bytes(data[:cut]) if cut is not None else bytes(data)


MUTATED = st.builds(_packed_and_mutated, VALUES, st.none() | st.integers(0, 1000), st.integers(0, 255),
                    st.none() | st.integers(0, 200))
ANY_BYTES = st.one_of(st.binary(max_size=200), ADVERSARIAL, MUTATED)
LIMITS = st.tuples(st.sampled_from([1, 2, 3, 7, 50, 65536]), st.sampled_from([0, 1, 2, 3, 4, 31, 32, 33, 64]))


@needs_kernel
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ANY_BYTES, LIMITS, st.integers(0, 8), st.integers(0, 8))
@example(b"\x81\x90\x01", (50, 32), 0, 0)  # an array key: unhashable
@example(b"\x81\x80\x01", (50, 32), 0, 0)  # a map key
@example(b"\x81\xa3\xed\xa0\x80\x01", (50, 32), 0, 0)  # a surrogate in a key
@example(b"\x91" * 32 + b"\x90", (65536, 32), 0, 0)  # 32 deep, then an empty array: taken
@example(b"\x91" * 33 + b"\x00", (65536, 32), 0, 0)  # 33 deep: refused
@example(b"\x92\x01", (50, 32), 0, 0)  # short
def test_the_compiled_check_accepts_and_ends_exactly_where_the_reference_does(data, limits, lead, trail):
    max_values, max_depth = limits
    buf = bytes(lead) + data + b"\x00" * trail  # a value inside a larger buffer, with bytes past its window
    for end in {lead + len(data), len(buf), lead + len(data) // 2}:
        want = check_value(buf, lead, end, max_values, max_depth)
        assert KERNEL.check_msgpack(buf, lead, end, max_values, max_depth) == want, (buf[lead:end], end)


def _any(data, kernel, monkeypatch, build):
    monkeypatch.setattr(packreader, "KERNEL", kernel)
    r = PackReader(data, CorruptData, "meta")
    try:
        value = r.any(T.MAX_META_BYTES, T.MAX_META_DEPTH, "a map", max_bytes=40, kind="map", build=build)
    except CorruptData as e:
        return "error", str(e), r.pos
    return "ok", value, r.pos


@needs_kernel
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ANY_BYTES, st.booleans())
@example(b"\x81\xca\x7f\x81\x00\x00\x00", True)  # a NaN (float32) as a map key
def test_any_gives_the_same_value_or_the_same_message_with_and_without_the_kernel(monkeypatch, data, build):
    fast, slow = (_any(data, k, monkeypatch, build) for k in (KERNEL, None))
    if fast[0] == slow[0] == "ok" and fast[1] != slow[1]:
        # A NaN somewhere, a value or a map key (two NaNs are never equal, nor two dicts keyed by
        # different NaN objects): the two values must pack to the same bytes instead.
        assert fast[2] == slow[2] and msgpack.packb(fast[1]) == msgpack.packb(slow[1])
        return
    assert fast == slow


def _hostile_batch() -> bytes:
    meta = T.pack_meta({"k": [[]] * (T.MAX_META_BYTES - 16)})  # 64 KiB of 0x90: the most values per byte
    n = T.MAX_BATCH_BYTES // (len(meta) + 64)
    return T.encode_batch([T.Record("n", "r", i, 1, 1.0, b"", meta) for i in range(n)])


@needs_kernel
def test_the_origin_checks_a_batch_of_tiny_containers_without_walking_or_building_them(monkeypatch):
    data = _hostile_batch()
    assert len(data) < 100_000  # what such a batch costs its sender on the wire
    calls = []
    monkeypatch.setattr(PackReader, "skip", lambda self, *a, **k: calls.append("skip"))
    monkeypatch.setattr(msgpack, "unpackb", lambda *a, **k: calls.append("unpackb"))
    records = T.decode_batch(data, packed_meta=True)  # its cost: bench/meta_check.py (the walk took ~3 s)
    assert calls == [] and len(records) > 180 and all(type(r.meta) is T.PackedMeta for r in records)


def test_a_refused_meta_says_the_same_with_and_without_the_kernel(monkeypatch):
    """The compiled check only ever says 'no': the message is always the reference's."""
    bad = T.pack_meta({"k": [[]] * 100})[:-1] + b"\xc1"  # the reserved byte at the end
    body = b"\x98" + msgpack.packb([T.KIND_RECORD, "n", "r", 1, 1, 1.0, b""])[1:] + bad  # 8 fields, meta last
    messages = []
    for kernel in (KERNEL, None):
        monkeypatch.setattr(packreader, "KERNEL", kernel)
        with pytest.raises(CorruptData, match="expected a meta map or nil, found ext or reserved") as e:
            T.decode_record(body, packed_meta=True)
        messages.append(str(e.value))
    assert messages[0] == messages[1]


def test_records_the_spool_reads_back_from_its_files_keep_their_metas_packed(tmp_path):
    """After a restart the spool's records come from its files, not its hot cache: their metas
    stay the bytes on disk (`PackedMeta`, as from the cache), which the uploader sends as they
    are. Before, each was built (64 KiB of empty arrays: ~6 ms and 4.5 MB) and packed again."""
    import trio

    from patchswarm.node.spool import TrajectorySpool

    meta = {"k": [[]] * 1000, "r": 1.5}

    async def main():
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        await sp.append([(b"p%d" % i, 1, meta) for i in range(3)], 1)
        await sp.aclose()
        sp = await TrajectorySpool.open(tmp_path, "n1", "r1")
        try:
            return sp.pending()
        finally:
            await sp.aclose()

    records = trio.run(main)
    assert [type(r.meta) for r in records] == [T.PackedMeta] * 3
    assert all(bytes(r.meta) == T.pack_meta(meta) for r in records)
    assert [r.meta for r in T.decode_batch(T.encode_batch(records))] == [meta] * 3
