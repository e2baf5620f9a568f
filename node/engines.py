"""Handing each new version to the local inference engine: SGLang, vLLM, or a command.

Owns the engine adapters (what each engine is told, and how success is read
from its answer) and `Handoff`, the one loop that feeds an engine: versions go
in order; a newer version supersedes one not yet handed over (logged, never
silent); a refused or failed hand-off is retried with jittered exponential
backoff until it succeeds or a newer version replaces it. The model directory
a hand-off names is held until the engine has answered.

- SGLang: `POST {url}/update_weights_from_disk` with `model_path` (the
  version's directory), `weight_version`, `load_format` "auto",
  `abort_all_requests` false, `flush_cache` true; success is HTTP 200 with
  `"success": true` (its server answers 400 with `"success": false` and a
  message otherwise).
- vLLM: stock servers reload from the path they were started with
  (`vllm serve DIR/current`, the model directory's atomically switched link):
  `POST {url}/collective_rpc` `{"method": "reload_weights"}` (served with
  `VLLM_SERVER_DEV_MODE=1`), then `POST {url}/reset_prefix_cache` so no cached
  prefix computed with the old weights is reused (a 404 there is tolerated).
  It opens each shard through `current` during the reload (`reads_current`):
  `Handoff` switches `current` to the version offered right before the
  reload, and nothing else moves it until the reload has returned.
- A command: run with PATCHSWARM_VERSION, PATCHSWARM_MODEL_DIR and
  PATCHSWARM_STATE_HASH in its environment; success is exit status 0, known when
  it exits (a child left in the background is not waited for); past the timeout
  the command and everything it started are killed.

Must not write model directories (node/modeldir.py does) nor decide which
versions exist (the daemon offers them).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Protocol

import httpx
import trio

from patchswarm.node.net.transport import one_line
from patchswarm.protocol.errors import PatchswarmError, UsageError

log = logging.getLogger("patchswarm.engine")

ENGINE_TIMEOUT = 600.0  # a reload of a large model takes minutes
BACKOFF_MIN, BACKOFF_MAX = 1.0, 60.0
ANSWER_MAX_BYTES = 64 * 1024  # of an engine's HTTP answer, read
COMMAND_OUTPUT_KEPT = 64 * 1024  # the tail of --on-version's output kept, for its last line
COMMAND_OUTPUT_GRACE_S = 1.0  # after it exits, how long its output is still read


class HandoffFailed(PatchswarmError):
    """The engine refused a version or could not be reached; the hand-off is retried."""


@dataclasses.dataclass(frozen=True)
class Offer:
    version: int
    path: Path  # the version's model directory
    state_hash: str
    published_at: float | None  # the manifest's created_at (wall clock), for publish->engine latency


class Engine(Protocol):
    name: str
    reads_current: bool  # reloads through the model directory's `current` link, not the offer's path

    async def load(self, offer: Offer) -> str:
        """Hand `offer` over; return the engine's message. Raise HandoffFailed."""


def _base(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"engine url: expected http://HOST:PORT, found {url!r}")
    try:  # at start, not as an exception out of the first hand-off, hours later
        u = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise UsageError(f"engine url: expected http://HOST:PORT, found {url!r} ({one_line(e)})") from None
    if not u.host or not 0 < (u.port or 80) < 65536:
        raise UsageError(f"engine url: expected http://HOST:PORT, found {url!r}")
    return url.rstrip("/")


@dataclasses.dataclass(frozen=True)
class _Answer:
    status_code: int
    content: bytes  # at most ANSWER_MAX_BYTES

    def json(self):
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")


async def _post(url: str, body: dict, timeout: float) -> _Answer:
    """POST `body`; the whole exchange within `timeout` (httpx's own timeout is per read: an
    engine that sends a byte now and then would hold the hand-off for ever), and only the
    first ANSWER_MAX_BYTES of the answer read (a hand-off answer is a few hundred bytes)."""
    try:
        with trio.fail_after(timeout):
            async with httpx.AsyncClient(timeout=timeout) as client:
                async with client.stream("POST", url, json=body, headers={"Accept-Encoding": "identity"}) as r:
                    content = bytearray()
                    async for chunk in r.aiter_bytes():
                        content += chunk[:ANSWER_MAX_BYTES - len(content)]
                        if len(content) >= ANSWER_MAX_BYTES:
                            break
                    return _Answer(r.status_code, bytes(content))
    except trio.TooSlowError:
        raise HandoffFailed(f"{url}: no whole answer within {timeout:.0f} s") from None
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise HandoffFailed(f"{url}: {type(e).__name__}: {one_line(e)}") from None


def _brief(text: str) -> str:
    """An engine's message as one line of at most 200 characters, for the log and the status."""
    return " ".join(text.split())[:200]


class SGLang:
    name = "sglang"
    reads_current = False

    def __init__(self, url: str, timeout: float = ENGINE_TIMEOUT):
        self.url = _base(url)
        self.timeout = timeout

    async def load(self, offer: Offer) -> str:
        r = await _post(f"{self.url}/update_weights_from_disk", {
            "model_path": str(offer.path), "load_format": "auto", "weight_version": str(offer.version),
            "abort_all_requests": False, "flush_cache": True}, self.timeout)
        try:
            answer = r.json()
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            answer = None
        message = (_brief(str(answer.get("message", ""))) if isinstance(answer, dict)
                   else "not a JSON object: " + (_brief(r.text)[:100] or "an empty body"))
        if r.status_code != 200 or not (isinstance(answer, dict) and answer.get("success") is True):
            raise HandoffFailed(f"sglang refused version {offer.version}: HTTP {r.status_code}"
                                f"{': ' + message if message else ''}")
        return message


class VLLM:
    name = "vllm"
    reads_current = True  # started on DIR/current; `offer.path` is not sent

    def __init__(self, url: str, timeout: float = ENGINE_TIMEOUT):
        self.url = _base(url)
        self.timeout = timeout

    async def load(self, offer: Offer) -> str:
        r = await _post(f"{self.url}/collective_rpc", {"method": "reload_weights"}, self.timeout)
        if r.status_code != 200:
            raise HandoffFailed(f"vllm refused version {offer.version}: HTTP {r.status_code}: {_brief(r.text)}")
        r2 = await _post(f"{self.url}/reset_prefix_cache", {}, 60.0)
        if r2.status_code not in (200, 404):
            raise HandoffFailed(f"vllm: reset_prefix_cache answered HTTP {r2.status_code}")
        return "reloaded"


class Command:
    name = "command"
    reads_current = False

    def __init__(self, command: str, timeout: float = ENGINE_TIMEOUT):
        if not command.strip():
            raise UsageError("--on-version: expected a command, found nothing")
        self.command = command
        self.timeout = timeout

    async def load(self, offer: Offer) -> str:
        env = {**os.environ, "PATCHSWARM_VERSION": str(offer.version), "PATCHSWARM_MODEL_DIR": str(offer.path),
               "PATCHSWARM_STATE_HASH": offer.state_hash}
        # Its own session (so a timeout ends the whole command, not only the shell), stdout and
        # stderr read into a bounded tail, and done when the command exits: a child it left in
        # the background (a server it started) may keep the pipe open for ever.
        try:
            proc = await trio.lowlevel.open_process(self.command, shell=True, env=env, stdin=subprocess.DEVNULL,
                                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                    start_new_session=True)
        except OSError as e:
            raise HandoffFailed(f"--on-version could not start: {one_line(e)}") from None
        tail = bytearray()
        output_done = trio.Event()

        async def read_output() -> None:
            try:
                while chunk := await proc.stdout.receive_some(65536):
                    tail.extend(chunk)
                    del tail[:-COMMAND_OUTPUT_KEPT]
            finally:
                output_done.set()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_output)
                with trio.move_on_after(self.timeout) as waited:
                    await proc.wait()
                if waited.cancelled_caught:
                    _kill_group(proc)
                    with trio.CancelScope(shield=True):
                        await proc.wait()
                with trio.move_on_after(COMMAND_OUTPUT_GRACE_S):  # what it wrote just before exiting
                    await output_done.wait()
                nursery.cancel_scope.cancel()
        except BaseException:
            _kill_group(proc)
            with trio.CancelScope(shield=True):
                await proc.wait()
            raise
        finally:
            with trio.CancelScope(shield=True):
                await proc.stdout.aclose()
        if waited.cancelled_caught:
            raise HandoffFailed(f"--on-version did not finish within {self.timeout:.0f} s") from None
        if proc.returncode != 0:
            last = bytes(tail).decode(errors="replace").strip().splitlines()[-1:] or [""]
            raise HandoffFailed(f"--on-version exited {proc.returncode}: {' '.join(last[0].split())[:200]}")
        return "ok"


def _kill_group(proc: trio.Process) -> None:
    """End a command still running, and everything it started (its own session: its pid is the group's)."""
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        proc.kill()


def make_engine(kind: str | None, url: str | None, command: str | None) -> Engine | None:
    if kind is None:
        if url is not None:
            raise UsageError("--engine-url needs --engine sglang|vllm")
        return Command(command) if command else None
    if command:
        raise UsageError("give either --engine or --on-version, not both")
    if url is None:
        raise UsageError(f"--engine {kind} needs --engine-url http://HOST:PORT")
    if kind == "sglang":
        return SGLang(url)
    if kind == "vllm":
        return VLLM(url)
    raise UsageError(f"--engine: expected sglang or vllm, found {kind!r}")


class Handoff:
    """Feeds one engine the versions offered, in order, newest pending wins, retried on failure.

    `switch`, for an engine that reloads through the model directory's `current` link
    (`reads_current`): run in a worker thread right before each hand-off with its version,
    so that `current` names the version offered from the start of the reload to its end
    (the writes leave `current` alone for such an engine: node/modelsink.py). A switch
    that fails fails that hand-off, which is retried as any other."""

    def __init__(self, engine: Engine, hold: Callable[[int], None] | None = None,
                 release: Callable[[int], None] | None = None, rng: random.Random | None = None,
                 switch: Callable[[int], None] | None = None):
        self.engine = engine
        self._hold = hold or (lambda v: None)
        self._release = release or (lambda v: None)
        self._switch = switch
        self._rng = rng or random.Random()
        self._pending: Offer | None = None
        self._in_flight: Offer | None = None  # being handed over now: held until the engine answers
        self._wake = trio.Event()
        self.delivered: int | None = None
        self.last_error: str | None = None
        self.last_latency_s: float | None = None
        self.attempts = 0
        self.superseded = 0
        self._delivered_event = trio.Event()

    def offer(self, offer: Offer) -> None:
        """A new verified version is in its directory; it replaces any not yet handed over."""
        if self.delivered is not None and offer.version <= self.delivered:
            return
        if self._pending is not None:
            if offer.version <= self._pending.version:
                return
            if self._pending is not self._in_flight:  # one being handed over now is not dropped
                log.info("engine %s: version %d supersedes version %d, not yet handed over",
                         self.engine.name, offer.version, self._pending.version)
                self.superseded += 1
                self._release(self._pending.version)
        self._hold(offer.version)
        self._pending = offer
        self._wake.set()

    async def wait_delivered(self, version: int) -> None:
        while self.delivered is None or self.delivered < version:
            await self._delivered_event.wait()

    async def run(self) -> None:
        backoff = BACKOFF_MIN
        while True:
            if self._pending is None:
                await self._wake.wait()
                self._wake = trio.Event()
                continue
            offer = self._in_flight = self._pending
            self.attempts += 1
            try:
                message = await self._load(offer)
            except Exception as e:  # an engine is another program: what it does must not end the node
                if not isinstance(e, HandoffFailed):
                    log.error("engine %s: version %d: unexpected error from the hand-off", self.engine.name,
                              offer.version, exc_info=True)
                    e = HandoffFailed(f"{type(e).__name__}: {one_line(e)}")
                self._in_flight = None
                if self._pending is not offer:  # superseded while it was tried
                    self._release(offer.version)
                    continue
                self.last_error = str(e)
                delay = backoff * (0.5 + self._rng.random() / 2)
                log.warning("engine %s: version %d not handed over (%s); retrying in %.1f s",
                            self.engine.name, offer.version, e, delay)
                backoff = min(BACKOFF_MAX, backoff * 2)
                with trio.move_on_after(delay):  # a newer offer retries at once
                    await self._wake.wait()
                self._wake = trio.Event()
                continue
            backoff = BACKOFF_MIN
            self.last_error = None
            if offer.published_at is not None:
                self.last_latency_s = round(time.time() - offer.published_at, 3)
            self._in_flight = None
            previous, self.delivered = self.delivered, offer.version
            if self._pending is offer:
                self._pending = None
            if previous is not None:
                self._release(previous)
            self._delivered_event.set()
            self._delivered_event = trio.Event()
            log.info("engine %s: version %d handed over (%s)", self.engine.name, offer.version, message or "ok")

    async def _load(self, offer: Offer) -> str:
        if self._switch is not None:
            try:
                await trio.to_thread.run_sync(self._switch, offer.version)
            except (OSError, PatchswarmError) as e:
                raise HandoffFailed(f"could not make version {offer.version} current: {one_line(e)}") from None
        return await self.engine.load(offer)

    def status(self) -> dict:
        return {"engine": self.engine.name, "engine_version": self.delivered,
                "pending_version": None if self._pending is None else self._pending.version,
                "last_error": self.last_error, "publish_to_engine_s": self.last_latency_s,
                "attempts": self.attempts, "superseded": self.superseded}
