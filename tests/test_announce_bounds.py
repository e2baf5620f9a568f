"""What a peer announces (Have, HaveOne, Incoming) is checked against the object's manifest and
costs nothing for an object whose manifest is not known here (issue 21, item 3).

In process, over the real Fetcher, PiecePicker and ObjectStore (tests/test_fetcher.py's)."""

from __future__ import annotations

import tracemalloc

import pytest
import trio

from patchswarm.protocol import wire
from patchswarm.protocol.errors import ProtocolError

from test_fetcher import KEY, _fetcher, _session


def _traced_peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_announcements_of_unknown_versions_cost_nothing(tmp_path):
    fetcher = _fetcher(tmp_path)
    ones = b"\xff" * wire.MAX_BITFIELD_BYTES  # every chunk a manifest may hold: 2**20

    async def main():
        async with trio.open_nursery() as n:
            s = _session(fetcher, n, "a")

            def flood():
                for v in range(100, 164):  # 64 versions no manifest here names
                    fetcher.on_announce(s, wire.Have(v, False, ones))
                    fetcher.on_announce(s, wire.HaveOne(v, True, wire.MAX_CHUNKS - 1))
                    fetcher.on_announce(s, wire.Incoming(v, True, 7))

            # Expanded and kept, the 64 Haves held 64 sets of 2**20 indices (~4 GB).
            assert _traced_peak(flood) < 1 << 20
            assert not any(fetcher.picker.announced("a", (v, kf), 7) for v in range(100, 164) for kf in (False, True))
            n.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.parametrize("msg", [
    wire.Have(KEY[0], KEY[1], b"\x01\x00"),  # two bytes for a 1-chunk object
    wire.Have(KEY[0], KEY[1], b"\x02"),  # bit 1 of a 1-chunk object
    wire.HaveOne(KEY[0], KEY[1], 1),
    wire.Incoming(KEY[0], KEY[1], 5),
])
def test_an_announcement_that_does_not_fit_the_manifest_is_a_protocol_error(tmp_path, msg):
    fetcher = _fetcher(tmp_path)

    async def main():
        async with trio.open_nursery() as n:
            s = _session(fetcher, n, "a")
            with pytest.raises(ProtocolError):
                fetcher.on_announce(s, msg)
            n.cancel_scope.cancel()

    trio.run(main)


def test_announced_chunks_checks_each_kind_against_the_chunk_count():
    assert wire.announced_chunks(wire.Have(1, False, bytes([0b101])), 3) == [0, 2]
    assert wire.announced_chunks(wire.HaveOne(1, False, 2), 3) == [2]
    assert wire.announced_chunks(wire.Incoming(1, False, 0), 3) == [0]
    for msg in (wire.Have(1, False, b"\xff" * 1000), wire.HaveOne(1, False, 2**20 - 1)):
        assert wire.announced_chunks(msg, None) is None
    with pytest.raises(ProtocolError, match="below 3"):
        wire.announced_chunks(wire.HaveOne(1, False, 3), 3)


def test_a_manifest_envelope_of_nested_arrays_costs_its_bytes():
    """A VersionNotice's envelope comes from any peer; it is read along its schema before a
    signature is checked (unpacked, 16 MiB of empty arrays cost ~1.2 GB)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from patchswarm.protocol.errors import CorruptData
    from patchswarm.protocol.manifest import verify_manifest

    n = 16 << 20
    envelope = b"\x92\xdd" + n.to_bytes(4, "big") + b"\x90" * n + b"\xc4\x00"
    key = Ed25519PrivateKey.generate().public_key()

    def verify():
        with pytest.raises(CorruptData):
            verify_manifest(envelope, key)

    assert _traced_peak(verify) < len(envelope) + (1 << 20)  # the one copy of its bytes
