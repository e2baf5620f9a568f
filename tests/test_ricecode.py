"""ricecode.py's helpers and the numpy decoders' messages, which the round trips (test_codec.py)
and the compiled-against-numpy comparisons (test_kernels.py) leave open."""

import numpy as np
import pytest

from patchswarm.protocol import ricecode
from patchswarm.protocol.errors import CorruptData


def test_cumsum_of_uint64_is_modular_and_stays_uint64():
    x = np.array([2**64 - 1, 2, 2**63, 2**63], dtype=np.uint64)
    out = ricecode.cumsum(x)
    assert out.dtype == np.uint64
    assert out.tolist() == [2**64 - 1, 1, 2**63 + 1, 1]
    assert ricecode.cumsum(np.array([-3, 5, 7], dtype=np.int64)).tolist() == [-3, 2, 9]


def test_a_raw_bit_field_of_the_wrong_length_is_refused_and_both_lengths_named():
    data = ricecode.pack_bits(np.arange(10, dtype=np.uint64), 12)  # 120 bits: 15 bytes
    assert len(data) == 15
    for fn in (ricecode.unpack_bits, ricecode._unpack_bits_numpy):
        with pytest.raises(CorruptData, match=r"^raw bit field: expected 15 bytes, found 16$"):
            fn(data + b"\x00", 12, 10)


@pytest.mark.parametrize("ks, found", [([0, 41], 41), ([3, -1], -1), ([41, 50], 50)])
def test_a_rice_parameter_out_of_range_is_named(ks, found):
    """The numpy decoder names the offending k: the largest, or a negative one (a per-value array
    wraps negatives to large unsigned values, so the smallest is the one to name)."""
    with pytest.raises(CorruptData, match=rf"^rice parameter: expected 0..40, found {found}$"):
        ricecode._unpack_numpy(b"\x00" * 8, 2, np.array(ks, dtype=np.int64))
