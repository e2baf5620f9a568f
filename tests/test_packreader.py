"""PackReader: reads what msgpack packs, refuses what does not fit, and never builds before it checks."""

from __future__ import annotations

import tracemalloc

import hypothesis.strategies as st
import msgpack
import pytest
from hypothesis import given, settings

from patchswarm.protocol.errors import CorruptData, PatchswarmError
from patchswarm.protocol.packreader import PackReader

SCALARS = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
           | st.text(max_size=40) | st.binary(max_size=40))
VALUES = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=6) | st.dictionaries(st.text(max_size=8), kids, max_size=6),
                      max_leaves=40)


def reader(data: bytes) -> PackReader:
    return PackReader(data, CorruptData, "test")


@settings(max_examples=300, deadline=None)
@given(VALUES)
def test_skip_and_any_agree_with_msgpack(value):
    data = msgpack.packb(value, use_bin_type=True)
    r = reader(data)
    assert r.any(10_000) == msgpack.unpackb(data, raw=False, strict_map_key=False)
    r.expect_end()


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**64 - 1), st.integers(-(2**63), -1), st.text(max_size=300), st.binary(max_size=70_000),
       st.booleans(), st.floats(allow_nan=False), st.lists(st.integers(0, 2**64 - 1), max_size=20))
def test_typed_reads_give_back_what_was_packed(u, neg, text, blob, flag, x, ints):
    data = msgpack.packb([u, neg, text, blob, flag, None, x, ints], use_bin_type=True)
    r = reader(data)
    assert r.array_len(8) == 8
    assert r.uint() == u
    assert r.int() == neg
    assert r.str(len(text.encode())) == text
    assert r.bin(len(blob)) == blob
    assert r.bool() is flag
    assert r.nil() and not r.nil()
    assert r.number() == x
    assert r.uints(r.array_len(20)) == ints
    r.expect_end()


@pytest.mark.parametrize("value, read, match", [
    ([1, 2, 3], lambda r: r.array_len(2), "at most 2 elements"),
    ({"a": 1}, lambda r: r.map_len(0), "at most 0 entries"),
    ("abcd", lambda r: r.str(3), "at most 3 bytes, found a length of 4"),
    (b"abcd", lambda r: r.bin(3), "at most 3 bytes, found a length of 4"),
    (300, lambda r: r.uint(255), r"in \[0, 255\], found 300"),
    (-1, lambda r: r.uint(), "found -1"),
    ([], lambda r: r.uint(), "found array"),
    ("x", lambda r: r.bin(9), "found str"),
    (1.5, lambda r: r.int(), "found float"),
    ([[[[1]]]], lambda r: r.skip(100, max_depth=2), "nested at most 2"),
    ([1, 2, 3, 4], lambda r: r.skip(4), "at most 4 values"),
])
def test_a_value_that_does_not_fit_is_refused(value, read, match):
    with pytest.raises(CorruptData, match=match):
        read(reader(msgpack.packb(value, use_bin_type=True)))


def test_a_length_beyond_the_bytes_present_is_refused_before_anything_is_built():
    cases = [
        (b"\xdd\xff\xff\xff\xff", lambda r: r.array_len(1 << 40)),  # 4 G elements, none present
        (b"\xdf\x00\x10\x00\x00" + b"\x00" * 100, lambda r: r.map_len(1 << 40)),
        (b"\xc6\x7f\xff\xff\xff", lambda r: r.bin(1 << 40)),
        (b"\xdb\x7f\xff\xff\xff", lambda r: r.str(1 << 40)),
        (b"\x91\xdd\x10\x00\x00\x00", lambda r: r.skip(1 << 40)),
    ]
    for data, read in cases:
        tracemalloc.start()
        try:
            with pytest.raises(CorruptData, match="bytes left|end of the data"):
                read(reader(data))
            assert tracemalloc.get_traced_memory()[1] < 1 << 16
        finally:
            tracemalloc.stop()


def test_ext_types_and_the_reserved_byte_are_refused():
    for data in (msgpack.packb(msgpack.ExtType(1, b"x")), b"\xc1", b"\xd4\x01\x00"):
        with pytest.raises(CorruptData, match="ext or reserved"):
            reader(data).skip(10)


def test_sixteen_mib_of_nested_arrays_cost_no_memory_to_refuse():
    data = b"\xdd\x01\x00\x00\x00" + b"\x91" * (16 << 20) + b"\x90"
    tracemalloc.start()
    try:
        with pytest.raises(CorruptData, match="nested at most"):
            reader(data).any(1 << 30)
        assert tracemalloc.get_traced_memory()[1] < 1 << 16
    finally:
        tracemalloc.stop()


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_end_in_a_value_or_a_clean_error(data):
    r = reader(data)
    try:
        while not r.at_end():
            r.any(1000)
    except PatchswarmError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 2**40), st.integers(0, 2**40)), max_size=20))
def test_uint_tuples_read_any_int_and_array_form(rows):
    data = msgpack.packb([list(r) for r in rows])
    r = reader(data)
    assert r.uint_tuples(r.array_len(100), 3, 2**40, "a piece") == rows
    long_form = b"\x91\xdc\x00\x03\x01\xcf" + (300).to_bytes(8, "big") + b"\x02"  # array16 header, uint64 form
    r = reader(long_form)
    assert r.uint_tuples(r.array_len(1), 3, 2**40, "a piece") == [(1, 300, 2)]
    with pytest.raises(CorruptData, match="another length"):
        r = reader(msgpack.packb([[1, 2]]))
        r.uint_tuples(r.array_len(1), 3, 10, "a piece")


@pytest.mark.parametrize("data, read", [
    (b"\xcb" + b"\x00" * 7, lambda r: r.float()),  # a float64 one byte short
    (b"\xca" + b"\x00" * 3, lambda r: r.float()),
    (b"\xce\x00\x01\x00", lambda r: r.int()),  # a uint32 one byte short
    (b"\xce\x00\x01\x00", lambda r: r.uint()),
])
def test_a_value_one_byte_short_is_refused_at_the_end_of_the_data_and_of_a_window(data, read):
    """A reader over a window (`end` before the data's end: a field inside a larger message)
    must not read the bytes after it."""
    with pytest.raises(CorruptData, match="the end of the data"):
        read(reader(data))
    with pytest.raises(CorruptData, match="the end of the data"):
        read(PackReader(data + b"\x00" * 8, CorruptData, "test", end=len(data)))


def test_piece_tuples_that_start_at_the_end_of_the_data_are_refused_far_into_it():
    """Past byte 256 positions are ints that are not one object each (a check by identity
    would read past the end)."""
    data = b"\x00" * 300
    for r in (PackReader(data, CorruptData, "test", start=300),  # end: len(data), another int object
              PackReader(data, CorruptData, "test", start=299, end=len(data) - 1)):
        with pytest.raises(CorruptData, match="the end of the data"):
            r.uint_tuples(1, 3, 1 << 40, "a piece")


def test_a_map_of_more_than_fifteen_entries_is_skipped_whole():
    """map16: 2 values an entry (the property test's maps are fixmaps)."""
    value = {f"k{i}": i for i in range(20)}
    data = msgpack.packb([value, 7], use_bin_type=True)
    r = reader(data)
    assert r.array_len(2) == 2
    assert r.skip(1000) == 41
    assert r.uint() == 7
    r.expect_end()
    assert reader(msgpack.packb(value)).any(1000) == value


def test_number_reads_ints_over_their_whole_range():
    for v in (0, 7, 200, 2**32, 2**64 - 1, -1, -(2**63)):
        assert reader(msgpack.packb(v)).number() == v


@pytest.mark.parametrize("value, kind", [([0, 0], "array"), ({"": 0}, "map"), (None, "nil"), (True, "bool"), ("ab", "str")])
def test_bin_refuses_other_kinds_whose_next_bytes_could_be_a_length(value, kind):
    with pytest.raises(CorruptData, match=f"expected bytes, found {kind}"):
        reader(msgpack.packb(value, use_bin_type=True) + b"\x00" * 4).bin(1 << 20)


def test_a_length_past_the_bytes_left_names_both():
    for data, read in [(b"\xc4\x05ab", lambda r: r.bin(100)), (b"\xd9\x05ab", lambda r: r.str(100))]:
        with pytest.raises(CorruptData, match="found a length of 5 with 2 bytes left at byte 2$"):
            read(reader(data))


def test_at_end_is_whether_any_byte_is_left():
    r = reader(msgpack.packb([1]))
    assert not r.at_end()
    r.skip(10)
    assert r.at_end()
    assert PackReader(b"\x01\x02", CorruptData, "test", end=1).at_end() is False
    assert PackReader(b"\x01\x02", CorruptData, "test", start=1, end=1).at_end() is True


def test_uints_take_zero_and_small_values_in_any_int_form():
    """Other writers may pack 0 as a uint64 or an int8 (msgpack allows any form that holds it)."""
    data = b"\xcf" + b"\x00" * 8 + b"\xd0\x00" + b"\xd1\x00\x05" + b"\xcd\x01\x00"
    assert reader(data).uints(4, 1000) == [0, 0, 5, 256]
    with pytest.raises(CorruptData, match=r"in \[0, 1000\], found -1"):
        reader(b"\xd0\xff").uints(1, 1000)


@pytest.mark.parametrize("data", [b"\x9f\x01\x02", b"\x8f\x01\x02\x03", b"\x93\x01\x02"])
def test_a_short_container_header_with_too_few_bytes_after_it_is_refused(data):
    """The fix forms too (the fast path): each element takes at least a byte, each entry two."""
    read = (lambda r: r.map_len(100)) if data[0] >> 4 == 0x8 else (lambda r: r.array_len(100))
    with pytest.raises(CorruptData, match="bytes left"):
        read(reader(data))


def test_bin_copies_and_bin_view_views_whatever_buffer_it_reads():
    packed = msgpack.packb([b"abc", b"defg"], use_bin_type=True)
    for data in (packed, bytearray(packed)):
        r = PackReader(data, CorruptData, "test")
        assert r.array_len(2) == 2
        first, second = r.bin(10), r.bin_view(10)
        assert type(first) is bytes and first == b"abc"
        assert second.readonly and second == b"defg"
        if type(data) is bytearray:
            data[-1] = ord("x")  # a view sees its buffer; a copy does not
            assert second == b"defx" and first == b"abc"
