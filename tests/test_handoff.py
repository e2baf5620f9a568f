"""Engine hand-offs: the model directory (node/modeldir.py) and the loop that feeds an engine
(node/engines.py), with a real HTTP server that speaks SGLang's weight-update shape and loads
what it is given."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import trio
import trio.testing
from safetensors.torch import load_file

from patchswarm.node.engines import Command, Handoff, HandoffFailed, Offer, SGLang, make_engine
from patchswarm.node.modeldir import ModelDir
from patchswarm.protocol.errors import UsageError
from patchswarm.protocol.served import file_tensor, file_tensor_name
from patchswarm.protocol.statehash import state_hash

HERE = Path(__file__).resolve().parent
LAYOUT = {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
          "c": "model-00002-of-00002.safetensors"}


def state(v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(v)
    return {"a": torch.randn(8, 8, generator=g).to(torch.bfloat16), "b": torch.full((3,), float(v)),
            "c": torch.arange(10, dtype=torch.int32)}


# ------------------------------------------------------------------ model directory


def test_versions_switch_atomically_and_unchanged_shards_are_linked(tmp_path):
    md = ModelDir(tmp_path / "md")
    s0, s1 = state(0), state(1)
    s1["c"] = s0["c"]  # shard 2 unchanged in version 1
    files = {"config.json": b"{}"}
    md.write(0, s0, LAYOUT, files, {"patchswarm.version": "0"})
    assert md.current_version() == 0
    n1 = md.write(1, s1, LAYOUT, files, {"patchswarm.version": "1"}, changed={"a", "b"})
    assert md.current_version() == 1 and os.readlink(md.current) == "versions/v0000000001"
    cur = md.current
    loaded = {**load_file(str(cur / LAYOUT["a"])), **load_file(str(cur / LAYOUT["c"]))}
    assert all(torch.equal(loaded[k].view(torch.uint8) if loaded[k].dtype == torch.bfloat16 else loaded[k],
                           s1[k].view(torch.uint8) if s1[k].dtype == torch.bfloat16 else s1[k]) for k in s1)
    index = json.loads((cur / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == LAYOUT and (cur / "config.json").read_bytes() == b"{}"
    # The unchanged shard is the same file (a hard link), not a second write; version 0 is gone.
    assert os.stat(cur / LAYOUT["c"]).st_nlink == 1  # v0 was pruned, so only v1 links it now
    assert n1 < sum(t.numel() * t.element_size() for t in s1.values()) + 4096 * 2
    assert sorted(p.name for p in (tmp_path / "md" / "versions").iterdir()) == ["v0000000001"]



def test_an_unchanged_single_file_carries_its_own_versions_metadata(tmp_path):
    """The defect: a single-file version whose weights did not change (only a side file did,
    or nothing) hard-linked the previous version's model.safetensors, whose header holds
    that version's metadata: version 2's file said version 1 and its state hash, and after a
    restart the sink took its own version 2 for another state and wrote it all again."""
    md = ModelDir(tmp_path / "md")
    s = state(0)
    md.write(1, s, None, {"config.json": b"{}"}, {"patchswarm.version": "1", "patchswarm.state_hash": "h1"})
    md.write(2, s, None, {"config.json": b"{\"x\": 1}"}, {"patchswarm.version": "2", "patchswarm.state_hash": "h2"},
             changed={file_tensor_name("config.json")})
    assert md.recorded(2) == {"format": "pt", "patchswarm.version": "2", "patchswarm.state_hash": "h2"}
    assert ModelDir(tmp_path / "md").recorded(2)["patchswarm.version"] == "2"
    assert (md.current / "config.json").read_bytes() == b'{"x": 1}'


@pytest.mark.parametrize("layout", [LAYOUT, None])
def test_every_weights_file_says_format_pt_as_transformers_requires(tmp_path, layout):
    """The defect: a single-file version's model.safetensors carried only the version's
    metadata, and transformers' load_state_dict refuses a safetensors file whose metadata
    has no "format" of pt, tf, flax or mlx: from_pretrained could not load the directory."""
    from safetensors import safe_open

    md = ModelDir(tmp_path / "md")
    md.write(1, state(1), layout, {}, {"patchswarm.version": "1"})
    files = sorted(md.current.glob("*.safetensors"))
    assert files
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            assert (st.metadata() or {}).get("format") == "pt", f.name


@pytest.mark.parametrize("layout", [LAYOUT, None])
def test_a_model_dir_left_by_another_state_is_written_again_not_offered(tmp_path, layout):
    """The defect: at start the sink took the model directory's `current` version on trust. One
    left by another swarm (or another life of this node's data dir) at version 3 made a node
    at version 3 offer those files to the engine as its own state, and a node below 3 write
    nothing until it passed 3. Now the version's recorded swarm and state hash are compared."""
    from patchswarm.node.modelsink import ModelSink
    from patchswarm.node.weights import Weights

    def weights(v, s, swarm):
        return Weights(s, v, state_hash(s), swarm)

    def held(root, version):
        d = root / "versions" / f"v{version:010d}"
        return {k: v for f in d.glob("*.safetensors") for k, v in load_file(str(f)).items()}

    root = tmp_path / "md"
    old = state(3)
    trio.run(ModelSink(root, None, 0).write, weights(3, old, "old-swarm"), layout, None, None)
    new = state(30)
    sink = ModelSink(root, None, 0)  # a restart
    trio.run(sink.write, weights(3, new, "sw"), layout, None, None)
    assert sink.version == 3 and torch.equal(held(root, 3)["b"], new["b"])
    sink = ModelSink(root, None, 0)  # the same state again: nothing to write
    before = sink.bytes_written
    trio.run(sink.write, weights(3, new, "sw"), layout, None, None)
    assert sink.bytes_written == before and sink.version == 3
    sink = ModelSink(root, None, 0)  # another swarm's newer version: the node's older one goes in
    trio.run(sink.write, weights(1, state(1), "other"), layout, None, None)
    assert sink.version == 1 and ModelDir(root).current_version() == 1
    assert torch.equal(held(root, 1)["b"], state(1)["b"])


def test_a_held_version_survives_until_released_and_crash_leftovers_go(tmp_path):
    md = ModelDir(tmp_path / "md")
    md.write(0, state(0), None, {}, {})
    md.hold(0)
    md.write(1, state(1), None, {}, {})
    assert (md.path(0) / "model.safetensors").exists(), "held by an engine still loading it"
    md.release(0)
    assert not md.path(0).exists()
    (tmp_path / "md" / "versions" / ".v0000000002.partial").mkdir()  # a write a crash cut short
    md2 = ModelDir(tmp_path / "md")
    assert md2.current_version() == 1
    assert sorted(p.name for p in (tmp_path / "md" / "versions").iterdir()) == ["v0000000001"]


# ------------------------------------------------------------------ the feeding loop


class ScriptedEngine:
    name = "scripted"

    def __init__(self, fail_first: int = 0):
        self.fail_first = fail_first
        self.calls: list[int] = []
        self.gate = trio.Event()

    async def load(self, offer: Offer) -> str:
        self.calls.append(offer.version)
        await self.gate.wait()
        if self.fail_first:
            self.fail_first -= 1
            raise HandoffFailed("not now")
        return "ok"


def test_versions_go_in_order_a_newer_supersedes_and_failures_are_retried():
    async def main():
        engine = ScriptedEngine(fail_first=2)
        held: dict[int, int] = {}
        h = Handoff(engine, hold=lambda v: held.__setitem__(v, held.get(v, 0) + 1),
                    release=lambda v: held.__setitem__(v, held[v] - 1))
        async with trio.open_nursery() as n:
            n.start_soon(h.run)
            h.offer(Offer(1, Path("/x/1"), "h1", time.time()))
            await trio.testing.wait_all_tasks_blocked()
            h.offer(Offer(2, Path("/x/2"), "h2", time.time()))  # while 1 is in flight
            h.offer(Offer(3, Path("/x/3"), "h3", time.time()))  # supersedes 2
            engine.gate.set()
            with trio.fail_after(600):
                await h.wait_delivered(3)
            n.cancel_scope.cancel()
        # 1 failed; 3 had superseded it by then, so 3 went next (failed once, retried, delivered).
        assert engine.calls[0] == 1 and engine.calls[-1] == 3 and 2 not in engine.calls
        assert h.delivered == 3 and h.superseded == 1 and h.last_error is None
        assert {v: c for v, c in held.items() if c} == {3: 1}, held  # only what the engine uses is held
        assert h.status()["engine_version"] == 3

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_failure_is_retried_until_it_succeeds_never_skipped():
    engine = ScriptedEngine(fail_first=3)
    engine.gate.set()
    h = _delivered(engine, 7)
    assert engine.calls == [7, 7, 7, 7] and h.attempts == 4


def _delivered(engine, version: int) -> Handoff:
    """A Handoff that was offered `version` alone, once `engine` has it (retries on a mock clock)."""
    async def main():
        h = Handoff(engine)
        async with trio.open_nursery() as n:
            n.start_soon(h.run)
            h.offer(Offer(version, Path(f"/x/{version}"), f"h{version}", None))
            with trio.fail_after(600):
                await h.wait_delivered(version)
            n.cancel_scope.cancel()
        return h

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_engine_choices_are_checked():
    assert make_engine(None, None, None) is None
    assert isinstance(make_engine(None, None, "true"), Command)
    assert isinstance(make_engine("sglang", "http://127.0.0.1:1", None), SGLang)
    for args in [("sglang", None, None), ("tgi", "http://x:1", None), (None, "http://x:1", None),
                 ("vllm", "http://x:1", "true"), ("sglang", "ftp://x", None)]:
        with pytest.raises(UsageError):
            make_engine(*args)


def test_on_version_command_gets_the_version_in_its_environment(tmp_path):
    out = tmp_path / "seen"

    async def main():
        cmd = Command(f'echo "$PATCHSWARM_VERSION $PATCHSWARM_MODEL_DIR $PATCHSWARM_STATE_HASH" >> {out}')
        await cmd.load(Offer(4, tmp_path / "v4", "blake3:ab", None))
        with pytest.raises(HandoffFailed, match="exited 3"):
            await Command("exit 3").load(Offer(5, tmp_path, "h", None))

    trio.run(main)
    assert out.read_text() == f"4 {tmp_path / 'v4'} blake3:ab\n"


# ------------------------------------------------------------------ a real HTTP engine


@pytest.fixture
def fake_engine(tmp_path):
    """Starts tests/engines/fake_engine.py (SGLang's endpoint; vLLM's too with `vllm_model`)."""
    port_file, log = tmp_path / "port", tmp_path / "engine.jsonl"
    procs = []

    def start(refuse: int = 0, vllm_model: Path | None = None, shard_pause: float = 0.0):
        vllm = [] if vllm_model is None else ["--vllm-model", str(vllm_model), "--shard-pause", str(shard_pause)]
        p = subprocess.Popen([sys.executable, str(HERE / "engines" / "fake_engine.py"), "--port-file", str(port_file),
                              "--log", str(log), "--refuse", str(refuse), *vllm])
        procs.append(p)
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text():
            assert time.monotonic() < deadline and p.poll() is None, "the fake engine did not start"
            time.sleep(0.05)
        return f"http://127.0.0.1:{port_file.read_text()}", log

    yield start
    for p in procs:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


@pytest.mark.slow
def test_sglang_shaped_engine_loads_each_version_in_order_and_refusals_are_retried(tmp_path, fake_engine):
    url, log = fake_engine(refuse=1)
    md = ModelDir(tmp_path / "md")
    files = {"config.json": b'{"model_type": "x"}'}
    hashes = {}

    async def main():
        h = Handoff(SGLang(url), hold=md.hold, release=md.release)
        async with trio.open_nursery() as n:
            n.start_soon(h.run)
            for v in range(3):
                s = state(v)
                md.write(v, s, LAYOUT, files, {})
                full = {**s, file_tensor_name("config.json"): file_tensor(files["config.json"])}
                hashes[v] = state_hash(full)
                h.offer(Offer(v, md.path(v), hashes[v], time.time()))
                with trio.fail_after(60):
                    await h.wait_delivered(v)
            n.cancel_scope.cancel()
        return h

    h = trio.run(main)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c["version"] for c in calls] == ["0", "1", "2"]
    assert [c["state_hash"] for c in calls] == [hashes[0], hashes[1], hashes[2]]
    assert h.attempts == 4  # the first call was refused and retried


@pytest.mark.slow
def test_vllm_shaped_engine_reloading_slowly_through_current_loads_whole_versions_as_they_arrive(tmp_path,
                                                                                                 fake_engine):
    """The defect: vLLM reloads through `D/current`, opening each shard as it comes to it, and
    `current` was switched with every version written: a version arriving during a reload gave
    it shards of two versions, and the node reported the older one handed over. Here a server
    reloads as vLLM does, slowly (0.4 s after each shard), while versions come every 0.25 s:
    each reload reads one version's directory, and the node reports that version."""
    from patchswarm.node.engines import VLLM
    from patchswarm.node.modelsink import ModelSink
    from patchswarm.node.weights import Weights

    class Recorded(VLLM):
        def __init__(self, url: str):
            super().__init__(url)
            self.handed: list[int] = []  # the versions reported handed over, in order

        async def load(self, offer):
            message = await super().load(offer)
            self.handed.append(offer.version)
            return message

    def version(v):
        s = {**state(v), "c": torch.arange(10, dtype=torch.int32) + v}  # every shard changes
        return Weights(s, v, state_hash(s), "sw")

    root = tmp_path / "md"
    url, log = fake_engine(vllm_model=root / "current", shard_pause=0.4)
    engine = Recorded(url)
    sink = ModelSink(root, engine, 0)

    async def main():
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(sink.run)
                for v in range(8):
                    await sink.write(version(v), LAYOUT, None if v == 0 else set(LAYOUT), time.time())
                    await trio.sleep(0.25)
                await sink.handoff.wait_delivered(7)
                n.cancel_scope.cancel()

    trio.run(main)
    reloads = [json.loads(line) for line in log.read_text().splitlines()]
    assert engine.handed[-1] == 7 and engine.handed == sorted(engine.handed) and len(reloads) == len(engine.handed)
    assert sink.handoff.superseded >= 1, "no version arrived during a reload: the test did not test it"
    for v, reload in zip(engine.handed, reloads):
        assert {Path(d).name for d in reload["read_from"]} == {f"v{v:010d}"}, (v, reload["read_from"])
        assert reload["state_hash"] == version(v).state_hash, v


def test_on_version_command_that_leaves_a_child_in_the_background_is_done_when_it_exits(tmp_path):
    """A hook that starts a server in the background (`server &`) exits 0 at once; the
    child still holds its stdout. It succeeded: not a timeout after ENGINE_TIMEOUT, retried
    (and another server started) for ever."""
    pid_file = tmp_path / "child.pid"

    async def main():
        t0 = time.monotonic()
        cmd = Command(f"sleep 60 & echo $! > {pid_file}; echo started", timeout=20)
        assert await cmd.load(Offer(1, tmp_path, "h", None)) == "ok"
        return time.monotonic() - t0

    try:
        assert trio.run(main) < 10
    finally:
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_on_version_command_past_its_timeout_is_ended_with_what_it_started(tmp_path):
    """A hook that hangs is ended at its timeout, the processes it started with it (the
    shell's children) included: none is left behind at each retry."""
    pid_file = tmp_path / "child.pid"

    async def main():
        cmd = Command(f"sleep 60 & echo $! > {pid_file}; wait", timeout=2)
        with pytest.raises(HandoffFailed, match="did not finish within 2 s"):
            await cmd.load(Offer(1, tmp_path, "h", None))

    trio.run(main)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError("the hook's child outlived its timeout")
        time.sleep(0.05)


def test_on_version_command_output_is_kept_bounded_and_its_last_line_reported(tmp_path):
    async def main():
        cmd = Command("head -c 20000000 /dev/zero | tr '\\0' x; echo; echo 'the real reason' >&2; exit 4", timeout=60)
        with pytest.raises(HandoffFailed, match="exited 4: the real reason$"):
            await cmd.load(Offer(1, tmp_path, "h", None))

    trio.run(main)


# ------------------------------------------------------------------ an engine on a bad day


async def _serve_once_each(answer, n):
    """Serve `answer(stream)` on a loopback port; `n`: the nursery. Returns the URL."""
    async def handler(stream):
        try:
            await stream.receive_some(65536)
            await answer(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    listeners = await n.start(lambda task_status: trio.serve_tcp(handler, 0, host="127.0.0.1",
                                                                 task_status=task_status))
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"


def _run_against(answer, timeout: float = 5.0) -> tuple[BaseException | str, float]:
    async def main():
        async with trio.open_nursery() as n:
            url = await _serve_once_each(answer, n)
            t0 = time.monotonic()
            try:
                with trio.fail_after(60):
                    out = await SGLang(url, timeout=timeout).load(Offer(1, Path("/x/1"), "h", None))
            except HandoffFailed as e:
                out = e
            n.cancel_scope.cancel()
            return out, time.monotonic() - t0

    return trio.run(main)


def test_an_engine_that_trickles_its_answer_is_given_up_on_at_the_timeout():
    async def trickle(stream):
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        for _ in range(100):  # a byte every half second: never a read timeout
            await trio.sleep(0.5)
            await stream.send_all(b" ")

    out, took = _run_against(trickle, timeout=2.0)
    assert isinstance(out, HandoffFailed) and "within 2 s" in str(out), out
    assert took < 5, took


def test_an_engine_answering_a_huge_body_is_not_read_whole():
    sent = [0]

    async def huge(stream):
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (1 << 30))
        chunk = b"x" * (1 << 20)
        for _ in range(1024):  # 1 GiB
            await stream.send_all(chunk)
            sent[0] += len(chunk)

    out, _ = _run_against(huge, timeout=30.0)
    assert isinstance(out, HandoffFailed) and "HTTP 200" in str(out), out
    assert sent[0] < (64 << 20), f"the node read {sent[0]:,} bytes of the answer"


def test_an_engines_message_is_logged_as_one_short_line():
    async def chatty(stream):
        body = json.dumps({"success": False, "message": "boom\nERROR forged log line\n" + "y" * 5000}).encode()
        await stream.send_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    out, _ = _run_against(chatty)
    assert isinstance(out, HandoffFailed), out
    assert "\n" not in str(out) and len(str(out)) < 300 and "boom ERROR forged log line" in str(out), str(out)[:300]


def test_an_engine_answering_json_nested_past_the_parsers_depth_is_a_refusal_not_a_crash():
    async def nested(stream):
        body = b"[" * 50000 + b"]" * 50000
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    out, _ = _run_against(nested)
    assert isinstance(out, HandoffFailed) and "HTTP 200" in str(out), out


def test_a_model_dir_removed_under_the_node_neither_ends_the_hand_off_nor_stops_later_versions(tmp_path):
    """Someone removes the model directory (or its disk goes) while the engine loads a
    version: the hand-off's release of the version before must not raise out of
    Handoff.run (which ends the node), and the next version is written again."""
    import shutil

    md = ModelDir(tmp_path / "md")
    state = {"w": torch.ones(4)}

    async def main():
        engine = ScriptedEngine()
        h = Handoff(engine, hold=md.hold, release=md.release)
        async with trio.open_nursery() as n:
            n.start_soon(h.run)
            for v in (1, 2):
                md.write(v, state, None, {}, {"v": str(v)})
                h.offer(Offer(v, md.path(v), f"h{v}", None))
                if v == 1:
                    engine.gate.set()
                    with trio.fail_after(10):
                        await h.wait_delivered(1)
                    engine.gate = trio.Event()
            await trio.testing.wait_all_tasks_blocked()  # version 2 in flight
            shutil.rmtree(md.root)
            engine.gate.set()
            with trio.fail_after(10):
                await h.wait_delivered(2)  # releases version 1: prunes a directory that is gone
            md.write(3, state, None, {}, {"v": "3"})
            h.offer(Offer(3, md.path(3), "h3", None))
            with trio.fail_after(10):
                await h.wait_delivered(3)
            n.cancel_scope.cancel()
        assert engine.calls == [1, 2, 3]
        assert md.current_version() == 3 and (md.current / "model.safetensors").exists()

    trio.run(main)


@pytest.mark.parametrize("layout", [LAYOUT, None])
def test_a_leftover_version_directory_of_another_state_is_written_again_not_made_current(tmp_path, layout):
    """The defect: a version directory that was not current (the engine held it when the
    earlier node stopped) was reused as whole by the next node to reach that version, even
    one of another swarm: the old swarm's files became `current` and were offered to the
    engine as the new node's state. Now a directory already there must record this state."""
    from patchswarm.node.modelsink import ModelSink
    from patchswarm.node.weights import Weights

    def weights(v, s, swarm):
        return Weights(s, v, state_hash(s), swarm)

    root = tmp_path / "md"
    old = ModelSink(root, None, 0)
    trio.run(old.write, weights(2, state(200), "old-swarm"), layout, None, None)
    old.dir.hold(2)  # an engine loading version 2 when that node stopped
    trio.run(old.write, weights(3, state(300), "old-swarm"), layout, None, None)
    assert ModelDir(root).path(2).exists()

    sink = ModelSink(root, None, 0)  # another swarm's node on the same model directory, at version 2
    mine = state(2)
    trio.run(sink.write, weights(2, mine, "sw"), layout, None, None)
    assert sink.version == 2 and sink.dir.current_version() == 2
    assert sink.dir.recorded(2)["patchswarm.swarm"] == "sw"
    loaded = {k: v for f in sink.dir.current.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert torch.equal(loaded["b"], mine["b"])


def test_an_engine_answering_html_says_so_in_the_error():
    """A proxy's or a wrong server's page (HTTP 200, HTML) was logged as only
    `sglang refused version 1: HTTP 200`, with no hint of what came back."""
    async def html(stream):
        body = b"<html>\n<body>502 Bad Gateway</body>\n</html>\n"
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\n\r\n" % len(body)
                              + body)

    out, _ = _run_against(html)
    assert isinstance(out, HandoffFailed), out
    assert "not a JSON object: <html> <body>502 Bad Gateway</body>" in str(out), str(out)


@pytest.mark.parametrize("url", ["http://[::1:30000", "http://:30000", "http://127.0.0.1:99999", "http://h\x00st:1"])
def test_an_engine_url_that_cannot_be_requested_is_a_usage_error_at_start(url):
    """The defect: only the scheme was checked; `http://[::1:30000` (a missing bracket) was
    taken, and the first hand-off, hours later, raised httpx.InvalidURL out of Handoff.run,
    which ended the node."""
    with pytest.raises(UsageError, match="engine url"):
        make_engine("sglang", url, None)


def test_an_unexpected_error_from_an_engine_adapter_is_retried_not_the_end_of_the_node():
    """Handoff.run let anything but HandoffFailed out, and with it the daemon's nursery
    ended: the node stopped serving its peers because of its engine (RecursionError from a
    deeply nested answer and httpx.InvalidURL did, before their own fixes)."""
    class Odd(ScriptedEngine):
        async def load(self, offer):
            self.calls.append(offer.version)
            if len(self.calls) == 1:
                raise RuntimeError("something the adapter did not expect")
            return "ok"

    engine = Odd()
    h = _delivered(engine, 1)
    assert engine.calls == [1, 1] and h.attempts == 2 and h.last_error is None
