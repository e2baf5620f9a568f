"""What a region's name may be: one rule for every place a member meets one. Sans-IO.

Owns `region_fault`: a certificate's region, a member's own --region, a peer's Hello
(node/net/trust.py, node/net/transport.py) and the origin's region signed into a
manifest (manifest.py `origin_region_of`) all pass it or are refused. No imports from
the rest of the package, so that manifest.py and wire.py may both use it.
"""

from __future__ import annotations

MAX_REGION_BYTES = 256  # wire.MAX_NAME_BYTES: what a Hello carries (tests/test_publication.py holds them equal)


def region_fault(region) -> str | None:
    """What keeps `region` from being a member's region, or None: it must be what a Hello
    carries (a str of 1 to MAX_REGION_BYTES bytes of UTF-8), printable, so a log line
    quoting it is one line."""
    if not isinstance(region, str) or not region:
        return "a non-empty str"
    if not region.isprintable():  # control characters, lone surrogates (not UTF-8)
        return "printable characters"
    if len(region.encode("utf-8")) > MAX_REGION_BYTES:
        return f"at most {MAX_REGION_BYTES} bytes of UTF-8"
    return None
