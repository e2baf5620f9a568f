"""What a peer announces (Have, HaveOne, Incoming) is checked against the object's manifest and
costs nothing for an object whose manifest is not known here (issue 21, item 3).

In process, over the real Fetcher, PiecePicker and ObjectStore (tests/test_fetcher.py's)."""

from __future__ import annotations


import pytest
import trio

from patchswarm.protocol import wire
from patchswarm.protocol.errors import ProtocolError

from test_fetcher import KEY, _fetcher, _session
from memory import traced_peak


def _knows_version_1(fetcher) -> None:
    """Give the fetcher a book that holds a signed manifest of version 1 (its latest)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from patchswarm.protocol.manifest import Manifest, sign_manifest
    from patchswarm.protocol.versions import VersionBook

    key = Ed25519PrivateKey.generate()
    fetcher.book = VersionBook("sw", key.public_key())
    m = Manifest(swarm_id="sw", version=1, base_version=0, base_hash="blake3:" + "00" * 32,
                 target_hash="blake3:" + "11" * 32, tensors=[], chunks=[(10, bytes(32))], codec={"format": 1},
                 created_at=0.0)
    fetcher.book.offer(sign_manifest(m, key))
    assert fetcher.book.latest_version == 1


ONES = b"\xff" * wire.MAX_BITFIELD_BYTES  # every chunk a manifest may hold: 2**20


def test_announcements_of_versions_far_from_the_known_ones_cost_nothing(tmp_path):
    fetcher = _fetcher(tmp_path)
    _knows_version_1(fetcher)

    async def main():
        async with trio.open_nursery() as n:
            s = _session(fetcher, n, "a")

            def flood():
                for v in range(100, 164):  # 64 versions far above the latest known (1)
                    fetcher.on_announce(s, wire.Have(v, False, ONES))
                    fetcher.on_announce(s, wire.HaveOne(v, True, wire.MAX_CHUNKS - 1))
                    fetcher.on_announce(s, wire.Incoming(v, True, 7))

            # Expanded and kept, the 64 Haves held 64 sets of 2**20 indices (~4 GB).
            assert traced_peak(flood) < 1 << 20
            fetcher.picker.add_object((100, False), 8, now=0.0)
            assert not fetcher.picker.announced("a", (100, False), 7)
            n.cancel_scope.cancel()

    trio.run(main)


def test_announcements_just_ahead_of_the_manifest_are_kept_bounded_and_count_once_it_arrives(tmp_path):
    """The origin announces a version to its peers as it tells the tracker: its Have often
    comes before the manifest, and it does not come again."""
    fetcher = _fetcher(tmp_path)
    _knows_version_1(fetcher)

    async def main():
        async with trio.open_nursery() as n:
            s = _session(fetcher, n, "a")

            def announce():
                for v in range(2, 18):  # every version the node keeps announcements of, ahead of its manifest
                    fetcher.on_announce(s, wire.Have(v, False, ONES))
                    for c in range(5000):
                        fetcher.on_announce(s, wire.HaveOne(v, True, c))

            # Kept as the bitfields' bytes and at most MAX_UNKNOWN_INDICES single chunks each.
            assert traced_peak(announce) < 16 * (wire.MAX_BITFIELD_BYTES + (1 << 17)) + (1 << 20)
            fetcher.picker.add_object((2, False), 3, now=0.0)
            fetcher.picker.add_object((2, True), 5000, now=0.0)
            assert all(fetcher.picker.holds_whole("a", (2, False), c) for c in range(3))
            assert fetcher.picker.holds_whole("a", (2, True), 0)
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

    assert traced_peak(verify) < len(envelope) + (1 << 20)  # the one copy of its bytes
