"""How a service's log lines look: text for people, JSON lines for machines.

Owns the two formatters and `setup_logging`. Text lines start with the local
date and time and its UTC offset (a line read days later, or beside another
host's, says when it happened); JSON lines are one object each with an
ISO-8601 UTC timestamp, the level, the service, the logger, an event name, the
formatted message and the fields. Must not decide what is logged.

Event names: a call may name its event and fields (`log.info(..., extra=
event("metrics_listening", addr=a))`); any other call gets a name made from its
message template (placeholders and punctuation dropped, words joined by `_`),
which is the same for every line that call writes, and its arguments as
`args`. So every line can be filtered by event without the modules that log
knowing about JSON.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import sys

FORMATS = ("text", "json")
_PLACEHOLDER = re.compile(r"%(?:\([^)]*\))?[-#0 +]*[\d*]*(?:\.[\d*]+)?[diouxXeEfFgGcrsa%]")
_NOT_WORD = re.compile(r"[^0-9a-z]+")
EVENT_NAME_CHARS = 60
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def event(name: str, **fields) -> dict:
    """`extra=` for a log call that names its event and fields (JSON lines carry them as is)."""
    return {"event": name, "fields": fields}


def event_name(template: object) -> str:
    """A stable name for a log call: its message template reduced to lowercase words."""
    words = _NOT_WORD.sub("_", _PLACEHOLDER.sub(" ", str(template)).lower()).strip("_")
    return words[:EVENT_NAME_CHARS].rstrip("_") or "message"


def _plain(v):
    """A JSON-safe value: numbers, strings, booleans and None as they are, containers walked, the rest str()."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
        return [_plain(x) for x in v]
    return str(v)


class TextFormatter(logging.Formatter):
    """`2026-11-02T14:03:07.412+01:00 node gpu-17 INFO message`."""

    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(record.created).astimezone().isoformat(timespec="milliseconds")
        line = f"{when} {self.service} {record.levelname} {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ISO-8601), level, service, logger, event, message, fields."""

    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        out = {"ts": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
               "level": record.levelname.lower(), "service": self.service, "logger": record.name,
               "event": getattr(record, "event", None) or event_name(record.msg),
               "message": record.getMessage()}
        fields = dict(getattr(record, "fields", None) or {})
        fields.update({k: v for k, v in vars(record).items() if k not in _STANDARD and k not in ("event", "fields")})
        if record.args and "event" not in vars(record):
            fields["args"] = record.args if isinstance(record.args, tuple) else [record.args]
        if fields:
            out["fields"] = _plain(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(service: str, verbose: bool = False, fmt: str = "text") -> None:
    """Route every logger to stderr in `fmt` (text or json), at DEBUG when `verbose`."""
    if fmt not in FORMATS:
        raise ValueError(f"log format: expected one of {FORMATS}, found {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else TextFormatter(service))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler], force=True)
