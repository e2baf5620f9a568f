"""node/failpoints.py: the spec it parses, and that `hold` holds only where armed, on trio's clock."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from patchswarm.node import failpoints
from patchswarm.protocol.errors import UsageError


def test_spec_parses_points_and_refuses_anything_else():
    assert failpoints._parse("a.b=sleep:30, c=sleep:0.5,") == {"a.b": 30.0, "c": 0.5}
    for bad in ("a=crash:1", "a=sleep:soon", "a"):
        with pytest.raises(UsageError, match="NAME=sleep:SECONDS"):
            failpoints._parse(bad)


def test_hold_logs_and_sleeps_the_task_only_where_armed(monkeypatch, caplog):
    monkeypatch.setattr(failpoints, "_points", {"upload.acked": 30.0})
    held = []

    async def main():
        async def other():  # the event loop goes on while one task holds
            await trio.sleep(1)
            held.append(("other ran at", trio.current_time()))

        async with trio.open_nursery() as n:
            n.start_soon(other)
            start = trio.current_time()
            await failpoints.hold("upload.sent")  # not armed: no wait
            held.append(("unarmed", trio.current_time() - start))
            await failpoints.hold("upload.acked")
            held.append(("armed", trio.current_time() - start))

    with caplog.at_level(logging.WARNING, logger="patchswarm.failpoint"):
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert held == [("unarmed", 0), ("other ran at", 1), ("armed", 30)]
    assert [r.getMessage() for r in caplog.records] == ["failpoint upload.acked: holding 30 s"]
