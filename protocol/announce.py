"""Who hears of a chunk this member receives: `Incoming` at its first part, `HaveOne` once verified.

A pure rule, with no I/O. The node daemon (node/fetcher.py) describes each
connected peer as a `Listener` (what that peer said of the chunk, whether
this session was told) and sends each message to the peers the rule names.

- `Incoming` (the chunk's first part arrived; it is served as it arrives)
  goes to every peer that announced neither the chunk nor its arrival and
  was not sent `Incoming` for it INCOMING_TELLS times on this session: they,
  the next region's gateway among them, may ask for it at once. A sender
  asked for a chunk may start its answer over at offset 0 (an honest one
  after a Cancel crossed its first answer, or a new source after a broken
  flow), and each start is a new first part, told again: a peer whose
  request to this member failed meanwhile asks it again only once it hears
  of the chunk anew, and a peer told `Incoming` gets no `HaveOne`. *Why a
  bound:* a hostile sender restarting in a loop had this member tell every
  peer once per restart, one small message each, until they dropped it past
  their announcements budget (node/peers.py). *Why not once:* the honest
  re-tell is how a peer whose request failed learns to ask here again; in
  the unequal-links bench once and three times measured the same (9 runs a
  side, bench/RESULTS.md "Incoming after a restart"), so the bound keeps the
  old behaviour for honest restarts at no cost.
- `HaveOne` (the chunk is held and verified) goes to every peer not sent
  `Incoming` for it on this session (one that reconnected meanwhile has a new
  session, which was not) that does not hold it whole; one still receiving
  it gets it, as its own flow may fail.
- A peer this member refused the chunk to (a Reject: not held, or its relay
  broke) since it last told it of the chunk hears of it again, both ways,
  whatever it announced or was told: the Reject made it stop counting this
  member a holder (protocol/picker.py asks a refuser again only once it
  announces the chunk anew). *Why:* with gateways killed mid-relay (issue 26),
  the holders of a broken chunk's first bytes refused each other the rest;
  the one that then fetched it whole told none of them, having sent each an
  `Incoming` before, and they waited 2 s for takeover (bench/RESULTS.md).
- Neither goes to the peer the chunk comes from, nor to the origin, which
  holds every chunk. Regions do not matter: takeover in a stalled region
  fetches from holders anywhere, so every region hears.

So each member sends one small message per chunk to each peer that lacks
it. Must not know about sessions or sockets.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Listener:
    """One connected peer, as far as the rule is concerned, for one chunk."""

    sender: bool = False  # the chunk comes from this peer
    origin: bool = False  # the origin: holds every chunk it announced
    same_region: bool = True  # not a factor (see the module doc); here so that tables can show it
    announced: bool = False  # said it holds the chunk or is receiving it (and did not refuse it since)
    whole: bool = False  # said it holds the chunk whole (Have, HaveOne); implies announced
    told: bool = False  # this session was sent Incoming for the chunk
    refused: bool = False  # this member sent it a Reject for the chunk since it last told it of the chunk
    told_enough: bool = False  # this session was sent Incoming for the chunk INCOMING_TELLS times


INCOMING_TELLS = 3  # Incoming for one chunk to one peer per session, at most (the first start and two restarts)


def tell_incoming(peer: Listener) -> bool:
    """Send `Incoming` for the chunk to `peer` (its first part arrived)?"""
    return not (peer.sender or peer.origin or peer.whole or (peer.announced or peer.told_enough) and not peer.refused)


def tell_have(peer: Listener) -> bool:
    """Send `HaveOne` for the chunk to `peer` (it is held and verified)?"""
    return not (peer.sender or peer.origin or peer.whole or peer.told and not peer.refused)
