"""Fabricated patches (tests/hostile_patches.py) end in a clean error within a memory budget.

Budget: every case's patch is under 1 MiB and its base is one 16 KB tensor (or
none); decoding it may allocate at most BUDGET, 32 MiB (traced numpy and Python
allocations, and growth of the peak RSS), whatever sizes it declares. Before
the bounded decoders each case took 65 MiB to 4.6 GiB, or crashed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hostile_patches import CASES, write_cases  # noqa: E402
from memory import traced_peak  # noqa: E402


BUDGET = 32 << 20


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    write_cases(folder)
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("hostile_patches.py")), str(folder)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_fabricated_patch_is_refused_cleanly_within_the_budget(measured, case):
    got = measured[case]
    assert got["bytes"] < 1 << 20
    assert got["outcome"].startswith("clean "), got
    assert got["traced_peak"] < BUDGET, got
    assert got["rss_growth"] < BUDGET, got


def test_a_rice_blob_is_refused_before_its_declared_count_is_allocated():
    from patchswarm.protocol import ricecode
    from patchswarm.protocol.errors import CorruptData

    tracemalloc.start()
    try:
        with pytest.raises(CorruptData, match="at least a bit per value"):
            ricecode.unpack(b"\x00" * 16, 1 << 27, 0)  # 1 GiB of uint64 if it were trusted
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert ricecode.unpack(b"\x00", 8, 0).tolist() == [0] * 8  # 8 zeros fill one byte exactly


def zstd_frame_declaring(content_size: int, rle_bytes: int) -> bytes:
    """A zstd frame whose header declares `content_size` and whose one block is an RLE
    block of `rle_bytes` zeros (a valid frame when the two are equal)."""
    header = bytes([0x28, 0xB5, 0x2F, 0xFD, 0xE0]) + content_size.to_bytes(8, "little")  # single segment, 8-byte size
    block = (rle_bytes << 3) | 0b011  # last block, RLE
    return header + block.to_bytes(3, "little") + b"\x00"


def test_byte_planes_are_checked_before_their_count_or_a_frame_s_declared_size_is_allocated():
    from patchswarm.protocol import planes
    from patchswarm.protocol.dtypes import info_named
    from patchswarm.protocol.errors import CorruptData

    bf16 = info_named("bf16")
    assert planes.decode([[1, zstd_frame_declaring(4, 4)], [0, b"\0" * 4]], 4, bf16).tolist() == [0] * 4

    def refused(planes_, count, match):
        with pytest.raises(CorruptData, match=match):
            planes.decode(planes_, count, bf16)

    # 2**27 elements from two empty raw planes (256 MiB if trusted)
    assert traced_peak(lambda: refused([[0, b""], [0, b""]], 1 << 27, "raw bytes")) < 1 << 20
    # a 17-byte frame that declares 1 GiB of content (zstd allocates what a frame declares)
    lie = [[1, zstd_frame_declaring(1 << 30, 4)], [0, b"\0" * 4]]
    assert traced_peak(lambda: refused(lie, 4, "declares")) < 1 << 20
    assert traced_peak(lambda: refused([[1, zstd_frame_declaring(1 << 30, 4)], [1, zstd_frame_declaring(1 << 30, 4)]],
                                       1 << 30, "can hold|declares")) < 1 << 20


def _keyframe_of(name: str, shape, pieces_planes, digests=None):
    from hostile_patches import _chunk, _container, _digest

    segs = [{"k": "f", "dt": "bf16", "p": [[0, s, e]], "pl": pl} for s, e, pl in pieces_planes]
    old, new = digests or (_digest(b""), _digest(b"".join(b"\0" * 2 * (e - s) for s, e, _ in pieces_planes)))
    return _container([(name, "bf16", shape)], [name], [_chunk(segs, old, new)], kind="keyframe")


def test_a_full_tensor_that_cannot_be_allocated_is_a_clean_error_and_leaves_the_state(monkeypatch):
    import torch

    from patchswarm.protocol import planes
    from patchswarm.protocol.errors import InvalidInput
    from patchswarm.protocol.patch import Patch, apply

    monkeypatch.setattr(planes, "ZSTD_MAX_RATIO", 1 << 60)  # past the bytes-per-chunk bound: the allocation itself
    data = _keyframe_of("w", (1 << 24, 1 << 24), [(0, 4, [[0, b"\0" * 4], [0, b"\0" * 4]])])
    state = {"old": torch.ones(3)}
    with pytest.raises(InvalidInput, match="allocating bf16"):
        apply(state, Patch.from_bytes(data))
    assert list(state) == ["old"] and torch.equal(state["old"], torch.ones(3))


def test_a_zstd_frame_declaring_more_than_the_format_can_expand_is_refused_before_it_is_decoded():
    """A zstd block holds at most 128 KiB in at least 4 bytes, so no frame expands past 32,768
    times its bytes (planes.ZSTD_MAX_RATIO, written here as the format's number): a frame whose
    header declares that much gets past the size check (and is then found undecodable: it holds
    16 MiB), one declaring a byte more is refused for its size, whatever the caller's limit."""
    import struct

    import zstandard

    from patchswarm.protocol import planes
    from patchswarm.protocol.errors import CorruptData

    frame = bytearray(zstandard.ZstdCompressor(level=1).compress(b"\0" * (16 << 20)))
    assert frame[4] == 0x80  # frame header: a 4-byte content size after the window byte
    at_bound = 32_768 * len(frame)
    for declared, message in [(at_bound, "undecodable zstd frame"),
                              (at_bound + 1, f"expected at most {at_bound} bytes of content from a frame of "
                                             f"{len(frame)}, found a frame that declares {at_bound + 1}")]:
        frame[6:10] = struct.pack("<I", declared)
        assert zstandard.frame_content_size(bytes(frame)) == declared
        with pytest.raises(CorruptData, match=f"^plane: {message}"):
            planes.decompress(bytes(frame), 1 << 40, "plane")


def test_full_tensors_must_be_covered_by_their_segments_before_the_state_hash_reads_them():
    from patchswarm.protocol.errors import CorruptData
    from patchswarm.protocol.patch import Patch, apply

    four = [[0, b"\0" * 4], [0, b"\0" * 4]]
    gap = _keyframe_of("w", (1 << 20,), [(0, 4, four)])  # 2 MiB declared, 8 bytes present
    with pytest.raises(CorruptData, match=r"cover \[0, 1048576\), found \[0, 4\)"):
        apply({}, Patch.from_bytes(gap))
    twice = _keyframe_of("w", (8,), [(0, 4, four), (2, 6, four), (6, 8, [[0, b"\0" * 2], [0, b"\0" * 2]])])
    with pytest.raises(CorruptData, match="an overlap at 2"):
        apply({}, Patch.from_bytes(twice))
    two = [[0, b"\0" * 2], [0, b"\0" * 2]]
    hole = _keyframe_of("w", (8,), [(0, 4, four), (6, 8, two), (4, 5, [[0, b"\0"], [0, b"\0"]])])  # [5, 6) missing
    with pytest.raises(CorruptData, match="a gap at 5"):
        apply({}, Patch.from_bytes(hole))


def test_a_full_segment_may_only_write_the_patch_s_full_tensors():
    import torch

    from hostile_patches import _chunk, _container, _digest
    from patchswarm.protocol.errors import CorruptData
    from patchswarm.protocol.patch import Patch, apply

    seg = {"k": "f", "dt": "bf16", "p": [[0, 0, 4]], "pl": [[0, b"\0" * 4], [0, b"\0" * 4]]}
    data = _container([("w", "bf16", (4,))], [], [_chunk([seg], _digest(b""), _digest(b"\0" * 8))])
    state = {"w": torch.ones(4, dtype=torch.bfloat16)}
    with pytest.raises(CorruptData, match="full list"):
        apply(state, Patch.from_bytes(data))
    assert torch.equal(state["w"], torch.ones(4, dtype=torch.bfloat16))


def test_a_table_of_more_rows_than_its_compressed_bytes_allow_is_refused_before_its_rows_are_read():
    """Rows that compress between 16x and 512x: inside the content bound (TABLE_MAX_RATIO),
    over the row bound (TABLE_ROWS_PER_BYTE per compressed byte, plus 64)."""
    import random

    import msgpack
    import zstandard

    from hostile_patches import _container
    from patchswarm.protocol import patchformat
    from patchswarm.protocol.errors import CorruptData
    from patchswarm.protocol.patch import Patch

    n = 20_000
    rng = random.Random(7)
    noise = bytes(rng.randrange(97, 123) for _ in range(1500)).decode()  # letters: ~0.6 compressed B each
    raw = msgpack.packb([[noise, "bf16", [1]]] + [["w", "bf16", [1]]] * n, use_bin_type=True)
    c = len(zstandard.ZstdCompressor(level=3).compress(raw))
    assert n > patchformat.TABLE_ROWS_PER_BYTE * c + 64 and len(raw) <= patchformat.TABLE_MAX_RATIO * c, c
    with pytest.raises(CorruptData, match=r"a list of \[name, dtype, shape\]"):
        Patch.from_bytes(_container([], [], [], table_raw=raw))


def test_a_table_exactly_at_the_row_bound_is_read_and_one_row_more_is_refused():
    """The row bound is 16 rows per compressed byte plus 64, exactly: a table of that many
    rows is read row by row, one of a row more is refused before any row is read. The bound
    is part of the format (a reader stricter than another refuses patches it reads), so it
    is written here as a number, not read from patchformat.TABLE_ROWS_PER_BYTE. Rows that
    dense must repeat (unique names cost more than 1/16 byte each), so the table at the
    bound is then refused for its repeated names: the check that comes after the rows."""
    rows_per_byte = 16
    import msgpack
    import zstandard

    from hostile_patches import _container
    from patchswarm.protocol import patchformat
    from patchswarm.protocol.errors import CorruptData
    from patchswarm.protocol.patch import Patch

    def table_over_bound_by(extra: int) -> bytes:
        """Raw rows whose count is 16 * (their compressed bytes) + 64 + extra."""
        n = 1000
        for _ in range(20):  # the compressed size barely moves with n: a fixed point in a few steps
            raw = msgpack.packb([["w", "bf16", [1]]] * n, use_bin_type=True)
            c = len(zstandard.ZstdCompressor(level=3).compress(raw))
            if n == rows_per_byte * c + 64 + extra:
                assert len(raw) <= patchformat.TABLE_MAX_RATIO * c  # inside the content bound
                return raw
            n = rows_per_byte * c + 64 + extra
        raise AssertionError(f"no table of {extra} rows over the bound found near {n} rows")

    with pytest.raises(CorruptData, match="tensor table: expected unique names in order"):
        Patch.from_bytes(_container([], [], [], table_raw=table_over_bound_by(0)))
    with pytest.raises(CorruptData, match=r"a list of \[name, dtype, shape\]"):
        Patch.from_bytes(_container([], [], [], table_raw=table_over_bound_by(1)))



def test_a_delta_segment_over_the_element_limit_is_refused_as_it_is_parsed():
    """MAX_SEGMENT_ELEMENTS (2**30) bounds what one segment makes the decoder allocate;
    one element more is refused before any of it is decoded."""
    from hostile_patches import HOLES, ONE_GAP, _chunk, _delta, _row
    from patchswarm.protocol.errors import CorruptData
    from patchswarm.protocol.patchformat import parse_chunk

    for size, ok in [((1 << 30), True), ((1 << 30) + 1, False)]:
        chunk = _chunk([_delta([[0, 0, size]], [0, 1], [_row(size - 1, size, HOLES)], ONE_GAP)])
        if ok:
            segs, _, _ = parse_chunk(chunk)
            assert segs[0].size == size
        else:
            with pytest.raises(CorruptData, match=r"segment: expected at most 1073741824 elements"):
                parse_chunk(chunk)


@pytest.mark.parametrize("dtype", ["fp64", "u16", "u32", "u64", "f8e8m0", "f8e4m3fnuz", "f8e5m2fnuz", "f4e2m1x2"])
def test_declared_sizes_in_segments_of_the_new_dtypes_are_refused_before_allocation(dtype):
    """The dtypes added on 2026-12-05 take other paths through the decoder (fp64: the numpy
    class index; u16/u32/u64: no class windows; 8-byte values: the numpy value pass): a class
    said to hold 2**29 elements and a class window on a dtype without classes end in
    CorruptData, allocating in proportion to the bytes, not to what they declare."""
    import torch
    from hostile_patches import HOLES, ONE_GAP, _chunk, _container, _row
    from patchswarm.protocol.dtypes import BY_NAME
    from patchswarm.protocol.errors import CorruptData
    from patchswarm.protocol.patch import Patch, apply

    if dtype not in BY_NAME:
        pytest.skip(f"this torch has no {dtype} (f8e8m0 came with 2.7, f4e2m1x2 with 2.8)")
    table = [("w", dtype, (8192,))]
    n = 1 << 29
    for window, rows, why in [([0, 1], [_row(n - 1, n, HOLES)], "class sizes: expected at most the segment's 8192"),
                              ([120, 2], [_row(n - 1, n, HOLES), [0]],
                               "class sizes" if BY_NAME[dtype].exponent else "segment class window")]:
        seg = {"k": "d", "dt": dtype, "p": [[0, 0, 8192]], "w": window, "c": rows, "s": ONE_GAP}
        state = {"w": torch.zeros(8192, dtype=BY_NAME[dtype].torch_dtype)}
        tracemalloc.start()
        try:
            with pytest.raises(CorruptData, match=why):
                apply(state, Patch.from_bytes(_container(table, [], [_chunk([seg])])))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20, peak
