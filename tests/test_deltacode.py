"""The delta code's choices per class (deltacode.py: the cheapest position and value codes) and
its checks' messages. The round trips are in test_codec.py and test_kernels.py: these pin what a
round trip cannot see, the size a choice costs."""

import numpy as np
import pytest

from patchswarm.protocol import deltacode
from patchswarm.protocol.errors import CorruptData


def encode_one(ranks, n: int, deltas):
    """Row and streams of one class of n members whose `ranks` changed by `deltas`."""
    rows, streams = deltacode.encode([np.asarray(ranks, dtype=np.int64)], [n], [np.asarray(deltas, dtype=np.int64)])
    return rows[0], streams


def decoded(row, streams):
    rows = deltacode.check_rows([row], 1)
    return deltacode.decode_positions(rows, streams), deltacode.decode_deltas(rows, streams)


def test_a_class_in_which_every_element_changed_sends_no_positions():
    """HOLES (gaps between unchanged ranks) of a class with none unchanged is empty: no position
    bits, where GAPS would send one bit per element and BITMAP one too."""
    n = 4096
    row, streams = encode_one(np.arange(n), n, np.ones(n))
    assert row[deltacode.PMODE] == deltacode.HOLES
    assert streams[0] == b"" and streams[1] == b""  # no Rice blob of positions, no bitmap
    positions, deltas = decoded(row, streams)
    assert np.array_equal(positions[0], np.arange(n))
    assert np.array_equal(deltas, np.ones(n))


def test_small_steps_with_some_of_one_size_above_cost_a_bit_a_value_for_their_magnitudes():
    """RUNS: where |d| > 1 as gaps, then |d| - 2 there as a ranked code. Steps of ±1 and ±17 in
    equal parts cost ~1 bit a value for the magnitudes (which ones are above 1: the 16 above is
    one symbol, so no ranks and no raw bits); RANKED would send a rank per value and 4 raw bits
    per ±17, ~3.5 bits a value."""
    rng = np.random.default_rng(5)
    m, n = 4000, 100_000
    ranks = np.sort(rng.choice(n, m, replace=False))
    deltas = np.where(rng.random(m) < 0.5, 1, 17) * np.where(rng.random(m) < 0.5, -1, 1)
    row, streams = encode_one(ranks, n, deltas)
    assert row[deltacode.VMODE] == deltacode.RUNS
    magnitude_bytes = sum(len(s) for s in streams[3:])  # bigs' gaps, ranks, raw low bits
    assert magnitude_bytes <= 1.05 * m / 8, magnitude_bytes
    assert len(streams[2]) == m // 8  # the signs: a raw bit each
    assert np.array_equal(decoded(row, streams)[1], deltas)


def test_wide_steps_take_the_ranked_code_within_a_few_percent_of_their_entropy():
    """RANKED: magnitudes spread evenly over 1..999 cost ~log2(999) bits a value; RUNS would add
    a gap per value (almost every one is above 1) on top of the same ranked code."""
    rng = np.random.default_rng(6)
    m, n = 4000, 100_000
    ranks = np.sort(rng.choice(n, m, replace=False))
    deltas = rng.integers(1, 1000, m) * np.where(rng.random(m) < 0.5, -1, 1)
    row, streams = encode_one(ranks, n, deltas)
    assert row[deltacode.VMODE] == deltacode.RANKED
    magnitude_bytes = sum(len(s) for s in streams[3:])
    assert magnitude_bytes <= 1.03 * m * np.log2(999) / 8, magnitude_bytes
    assert np.array_equal(decoded(row, streams)[1], deltas)


def test_wrong_sign_bytes_are_refused_and_counted():
    row, streams = encode_one(np.arange(10), 100, np.ones(10))
    assert len(streams[2]) == 2 and len(streams[3]) == 0
    streams[2] += b"\x00"
    with pytest.raises(CorruptData, match=r"^signs: expected 2 bytes for 10 changes, found 3$"):
        deltacode.check_counts([row], streams, 100)
