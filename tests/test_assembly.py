"""Chunks in parts: splitting, reassembly, and what a relay may forward before verifying."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from patchswarm.protocol.assembly import ChunkAssembly
from patchswarm.protocol.errors import ProtocolError, UsageError


@given(st.binary(max_size=3000), st.lists(st.integers(1, 900), min_size=1, max_size=20))
def test_any_split_reassembles_and_holds_back_the_last_part(data, cuts):
    asm = ChunkAssembly(len(data), len(data))
    pos, i, last_start = 0, 0, 0
    if not data:
        assert asm.add(0, 0, b"")
    while pos < len(data):
        end = min(len(data), pos + cuts[i % len(cuts)])
        done = asm.add(pos, len(data), data[pos:end])
        last_start, pos, i = pos, end, i + 1
        assert done == (pos == len(data))
        # Before verification a relay may send on everything except the completing part.
        assert asm.forwardable == (pos if not done else last_start)
        assert asm.view(0, asm.forwardable) == data[:asm.forwardable]
    assert bytes(asm.data()) == data
    asm.mark_verified()
    assert asm.forwardable == len(data) and asm.view(0, len(data)) == data


def test_parts_must_continue_the_chunk():
    asm = ChunkAssembly(10, 10)
    with pytest.raises(ProtocolError, match="expected the part at offset 0, found offset 4"):
        asm.add(4, 10, b"abcd")
    asm.add(0, 10, b"abcd")
    for total in (12, 8):  # a larger total, or a smaller one that this part would still fit
        with pytest.raises(ProtocolError, match=f"expected total 10 for every part of the chunk, found {total}"):
            asm.add(4, total, b"ef")
    with pytest.raises(ProtocolError, match="within 10 bytes, found 7 bytes at offset 4"):
        asm.add(4, 10, b"efghijk")
    with pytest.raises(ProtocolError, match="non-empty part"):
        asm.add(4, 10, b"")
    with pytest.raises(ProtocolError, match="expected a chunk of 10 bytes .*found a total of 11"):
        ChunkAssembly(11, 10)


def test_misuse_is_the_callers_fault():
    asm = ChunkAssembly(4, 4)
    asm.add(0, 4, b"ab")
    with pytest.raises(UsageError, match="not whole"):
        asm.mark_verified()
    with pytest.raises(UsageError, match="within the 2 forwardable bytes"):
        asm.view(0, 3)


def test_a_faster_declared_uplink_sends_larger_parts():
    """A part takes about PART_SECONDS on a quarter of the uplink: 64 KiB where none is
    declared and up to ~300 Mbit/s (the relay's lag per hop, measured at 100 Mbit/s),
    larger at 1-10 Gbit/s, where each message's fixed cost would take the CPU instead."""
    from patchswarm.protocol.assembly import MAX_PART_BYTES, PART_BYTES, part_bytes_for
    assert part_bytes_for(None) == part_bytes_for(10) == part_bytes_for(100) == part_bytes_for(300) == PART_BYTES
    assert part_bytes_for(1000) == 256 << 10 and part_bytes_for(2000) == 512 << 10
    assert part_bytes_for(10_000) == part_bytes_for(10_000_000) == MAX_PART_BYTES == 1 << 20
    sizes = [part_bytes_for(m) for m in range(1, 20_000, 37)]
    assert sizes == sorted(sizes) and all(n & (n - 1) == 0 for n in sizes)
