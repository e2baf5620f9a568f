"""Who hears of a chunk this member receives (protocol/announce.py), as two tables of peer kinds:
`Incoming` when its first part arrives, `HaveOne` once it is verified. The daemon's use of the
rule, with sessions, is in test_node_relay.py."""

import pytest

from patchswarm.protocol.announce import Listener, tell_have, tell_incoming

NOTHING = Listener()  # a node of my region that said nothing of the chunk


@pytest.mark.parametrize("peer, told", [
    (Listener(sender=True, announced=True), False),  # the chunk comes from it
    (Listener(origin=True), False),  # holds every chunk
    (Listener(origin=True, same_region=False), False),
    (NOTHING, True),  # may follow the chunk from here at once
    (Listener(same_region=False), True),  # the next region's gateway among them
    (Listener(announced=True, whole=True), False),  # holds it whole
    (Listener(announced=True, same_region=False), False),  # is receiving it (said Incoming)
    (Listener(announced=False), True),  # said it, then refused it (a Reject): as one that never had it
    # Issue 26: I refused it the chunk (my relay broke), so it no longer counts me a holder.
    (Listener(announced=True, refused=True), True),
    (Listener(announced=True, whole=True, refused=True), False),  # refused, then got it whole elsewhere
    # Told already (the sender restarted the chunk at offset 0): again, up to INCOMING_TELLS times
    # per session, then no more unless refused since.
    (Listener(told=True), True),
    (Listener(told=True, told_enough=True), False),
    (Listener(told=True, told_enough=True, refused=True), True),
], ids=["sender", "origin", "origin elsewhere", "same region", "other region", "holds it whole",
        "receiving it", "refused it", "receiving it, I refused it", "I refused it, it holds it whole",
        "told", "told enough", "told enough, then I refused it"])
def test_incoming_goes_to_peers_that_said_nothing_of_the_chunk(peer, told):
    assert tell_incoming(peer) is told


@pytest.mark.parametrize("peer, told", [
    (Listener(sender=True, announced=True, whole=True), False),
    (Listener(origin=True), False),
    (Listener(told=True), False),  # it knows: the Incoming said so
    (Listener(told=True, same_region=False), False),
    (NOTHING, True),  # connected after the first part: was not told
    (Listener(same_region=False), True),
    (NOTHING, True),  # a told peer that reconnected: its new session was not told
    (Listener(announced=True, whole=True), False),  # holds it whole
    (Listener(announced=True, whole=True, told=True), False),  # told, then got it whole elsewhere
    (Listener(announced=True), True),  # still receiving it: its own flow may fail
    (Listener(announced=True, told=True), False),
    (Listener(announced=False), True),  # refused it
    # Issue 26: told it was coming, then refused it (my relay broke): it waits on takeover unless told.
    (Listener(told=True, refused=True), True),
    (Listener(announced=True, told=True, refused=True), True),
    (Listener(announced=True, whole=True, told=True, refused=True), False),
], ids=["sender", "origin", "told", "told elsewhere", "connected late", "other region, not told",
        "reconnected", "holds it whole", "told, holds it whole", "receiving it", "receiving it, told",
        "refused it", "told, then I refused it", "receiving it, told, then I refused it",
        "I refused it, it holds it whole"])
def test_haveone_goes_to_peers_not_told_that_do_not_hold_it_whole(peer, told):
    assert tell_have(peer) is told
