"""Log lines: text with the date and UTC offset; JSON one object per line with a UTC timestamp, event and fields."""

from __future__ import annotations

import datetime
import io
import json
import logging
import re

import pytest

from patchswarm.node.net.logs import JsonFormatter, TextFormatter, event, event_name


def _line(formatter: logging.Formatter, msg: str, *args, extra=None, exc=None) -> str:
    log = logging.getLogger("patchswarm.test-logs")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    log.addHandler(handler)
    log.propagate = False
    try:
        if exc is not None:
            try:
                raise exc
            except type(exc):
                log.exception(msg, *args, extra=extra)
        else:
            log.warning(msg, *args, extra=extra)
    finally:
        log.removeHandler(handler)
    return stream.getvalue()


def test_text_line_has_date_time_and_offset():
    line = _line(TextFormatter("node gpu-17"), "applied version %d", 3)
    m = re.match(r"(\S+) node gpu-17 WARNING applied version 3\n$", line)
    assert m, line
    when = datetime.datetime.fromisoformat(m.group(1))
    assert when.tzinfo is not None
    assert abs((datetime.datetime.now(datetime.timezone.utc) - when).total_seconds()) < 60


def test_json_line_is_one_object_with_utc_time_event_and_args():
    line = _line(JsonFormatter("node gpu-17"), "applied version %d (%s) in %.2f s", 3, "patch", 0.5)
    assert line.count("\n") == 1
    obj = json.loads(line)
    assert obj["ts"].endswith("Z")
    when = datetime.datetime.fromisoformat(obj["ts"].replace("Z", "+00:00"))
    assert when.utcoffset() == datetime.timedelta(0)
    assert obj["level"] == "warning" and obj["service"] == "node gpu-17" and obj["logger"] == "patchswarm.test-logs"
    assert obj["event"] == "applied_version_in_s"
    assert obj["message"] == "applied version 3 (patch) in 0.50 s"
    assert obj["fields"] == {"args": [3, "patch", 0.5]}


def test_json_named_event_and_fields_and_odd_values():
    line = _line(JsonFormatter("tracker t"), "peer %s left", "n1",
                 extra=event("peer_left", peer="n1", path=__import__("pathlib").Path("/x"), ids={1, 2}))
    obj = json.loads(line)
    assert obj["event"] == "peer_left" and obj["fields"]["peer"] == "n1" and obj["fields"]["path"] == "/x"
    assert sorted(obj["fields"]["ids"]) == [1, 2] and "args" not in obj["fields"]


def test_json_exception_stays_on_one_line():
    line = _line(JsonFormatter("node n"), "handler failed", exc=ValueError("boom\nsecond line"))
    assert line.count("\n") == 1
    obj = json.loads(line)
    assert "ValueError: boom" in obj["exception"] and obj["event"] == "handler_failed"


@pytest.mark.parametrize("template, name", [
    ("node %s (region %s) listening on %s, at %s; local socket %s", "node_region_listening_on_at_local_socket"),
    ("%(a)s=%(b)05.1f%%", "message"),
    ("lost the tracker (%s); reconnecting", "lost_the_tracker_reconnecting"),
])
def test_event_names_come_from_the_template(template, name):
    assert event_name(template) == name
