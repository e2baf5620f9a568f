"""`current` switched only between reloads, for an engine that reloads through it (vLLM).

The defect: the model directory switched `D/current` with every version written, and
vLLM's reload opens each shard through that link: a version written while a reload ran
gave vLLM shard 1 of one version and shard 2 of the next, and the node reported the
older one handed over. Now, for such an engine, versions are written to their own
directories at once and `current` is switched by the hand-off right before the reload
that loads it (node/modelsink.py, node/engines.py `Handoff`, node/modeldir.py).

Real files, bit-exact comparisons; every wait is bounded.
"""

from __future__ import annotations

import json
import os

import torch
import trio
from safetensors.torch import load_file

from patchswarm.node.checkpoint import INDEX_NAME
from patchswarm.node.engines import Handoff, Offer
from patchswarm.node.modeldir import ModelDir
from patchswarm.node.modelsink import ModelSink
from patchswarm.node.weights import META_HASH, META_SWARM, META_VERSION, Weights
from patchswarm.protocol.statehash import state_hash
from swarmlab import same_bits

SHARD = {t: f"model-0000{i}-of-00003.safetensors" for i, t in enumerate("abc", 1)}
LAYOUT = {"a": SHARD["a"], "b": SHARD["b"], "c": SHARD["c"]}  # one tensor a shard
SWARM = "sw"
WAIT_S = 30  # any one test's waits together; each takes well under a second


def state(v: int) -> dict[str, torch.Tensor]:
    """Version `v`: every tensor differs from every other version's."""
    g = torch.Generator().manual_seed(v)
    return {"a": torch.randn(16, 16, generator=g).to(torch.bfloat16), "b": torch.randn(32, generator=g),
            "c": torch.full((8,), v, dtype=torch.int32)}


def weights(v: int, s: dict[str, torch.Tensor] | None = None) -> Weights:
    s = state(v) if s is None else s
    return Weights(s, v, state_hash(s), SWARM)


def meta(v: int, s: dict[str, torch.Tensor]) -> dict[str, str]:
    return {META_VERSION: str(v), META_HASH: state_hash(s), META_SWARM: SWARM}


def loaded(d) -> dict[str, torch.Tensor]:
    return {k: t for f in sorted(d.glob("*.safetensors")) for k, t in load_file(str(f)).items()}


def version_dirs(md: ModelDir) -> list[int]:
    return sorted(int(p.name[1:]) for p in (md.root / "versions").iterdir() if p.name.startswith("v"))


class ReadsThroughCurrent:
    """An engine in this process that reloads as vLLM does: the index, then each shard, opened
    through `D/current` one at a time. After the first shard it says which version it was
    offered on `paused` and waits for a word on `resume` (with `pause`; else it goes on)."""

    name = "through-current"
    reads_current = True

    def __init__(self, root, pause: bool = True):
        self.current = root / "current"
        self.pause = pause
        self.reads: list[tuple[int, dict[str, torch.Tensor]]] = []  # (version offered, what it read)
        self.paused_tx, self.paused = trio.open_memory_channel(0)
        self.resume_tx, self.resume = trio.open_memory_channel(0)

    async def load(self, offer) -> str:
        index = json.loads((self.current / INDEX_NAME).read_text())
        got: dict[str, torch.Tensor] = {}
        for i, shard in enumerate(sorted(set(index["weight_map"].values()))):
            got.update(load_file(str(self.current / shard)))
            if i == 0 and self.pause:
                await self.paused_tx.send(offer.version)
                await self.resume.receive()
        self.reads.append((offer.version, got))
        return "reloaded"


def with_handoff(feeder: ModelSink | Handoff, script) -> None:
    """Run `script()` while `feeder.run` feeds the engine, all within WAIT_S; then stop it."""
    async def main():
        with trio.fail_after(WAIT_S):
            async with trio.open_nursery() as n:
                n.start_soon(feeder.run)
                await script()
                n.cancel_scope.cancel()

    trio.run(main)


async def write(sink: ModelSink, v: int) -> None:
    """Version `v` through the sink, as the daemon writes it after applying its patch (all changed)."""
    await sink.write(weights(v), LAYOUT, set(LAYOUT), None)


def test_a_reload_through_current_reads_one_versions_shards_while_newer_versions_are_written(tmp_path):
    """Versions 2, 3 and 5 are written while a reload is between its first and second shard:
    each reload reads the shards of the version it was offered, bit for bit, and the node
    reports that version handed over; the reload after one loads the newest version written."""
    root = tmp_path / "md"
    engine = ReadsThroughCurrent(root)
    sink = ModelSink(root, engine, 0)

    async def script():
        await write(sink, 1)
        assert await engine.paused.receive() == 1
        for v in (2, 3):  # while the reload of version 1 is half-way
            await write(sink, v)
            assert sink.dir.current_version() == 1 and sink.version == v
        await engine.resume_tx.send(None)
        assert await engine.paused.receive() == 3  # 2 was superseded: the newest written goes next
        await write(sink, 4)
        await write(sink, 5)
        assert sink.dir.current_version() == 3
        await engine.resume_tx.send(None)
        assert await engine.paused.receive() == 5
        await engine.resume_tx.send(None)
        await sink.handoff.wait_delivered(5)

    with_handoff(sink, script)
    assert [v for v, _ in engine.reads] == [1, 3, 5]
    for v, got in engine.reads:
        assert same_bits(got, state(v)), f"the reload offered version {v} read shards of another version"
    assert sink.handoff.delivered == 5 and sink.handoff.superseded == 2
    assert sink.dir.current_version() == 5 and sink.status()["model_dir_version"] == 5


def test_unchanged_shards_are_linked_from_the_version_written_last_not_from_current(tmp_path):
    """`changed` is relative to the version written before (the daemon's patch v-1 -> v), so
    while `current` is held at version 1, version 3's shard of `a` (changed in 2, not in 3)
    must come from version 2: from `current` it would be version 1's `a`, silently stale."""
    md = ModelDir(tmp_path / "md")
    s1 = state(1)
    s2 = {**s1, "a": state(2)["a"]}
    s3 = {**s2, "b": state(3)["b"]}
    md.write(1, s1, LAYOUT, {}, meta(1, s1))
    md.hold(1)  # being reloaded through `current`
    md.write(2, s2, LAYOUT, {}, meta(2, s2), changed={"a"}, switch=False)
    md.hold(2)  # offered, pending
    n3 = md.write(3, s3, LAYOUT, {}, meta(3, s3), changed={"b"}, switch=False)
    assert md.current_version() == 1 and md.written == 3
    assert same_bits(loaded(md.path(3)), s3)
    assert os.stat(md.path(3) / SHARD["a"]).st_ino == os.stat(md.path(2) / SHARD["a"]).st_ino
    assert os.stat(md.path(3) / SHARD["c"]).st_ino == os.stat(md.path(1) / SHARD["c"]).st_ino
    assert n3 < (md.path(3) / SHARD["b"]).stat().st_size + (md.path(3) / INDEX_NAME).stat().st_size + 1, \
        "only the shard of `b` and the index are written"
    md.release(2)  # superseded by 3
    md.switch(3)
    md.release(1)
    assert md.current_version() == 3 and version_dirs(md) == [3]
    assert same_bits(loaded(md.current), s3)


async def pruned(sink: ModelSink) -> None:
    """Until the directory holds only what the sink keeps (the released versions are pruned in
    a worker thread, after the release); 5 s at most."""
    for _ in range(500):
        keep = {sink.dir.current_version(), sink.dir.written, *sink.dir._held}
        if set(version_dirs(sink.dir)) <= keep:
            return
        await trio.sleep(0.01)
    raise AssertionError(f"not pruned within 5 s: {version_dirs(sink.dir)}, keeping {keep}")


def test_a_stuck_reload_keeps_current_and_the_directory_holds_a_bounded_number_of_versions(tmp_path):
    """Twenty versions arrive while the reload of version 1 is stuck: `current` stays at 1 and
    at most three version directories are kept (current and in reload, the version handed
    over before it, the newest written, pending; a superseded one goes in a worker thread
    just after: `pruned`); once the reload returns, the newest goes in and the others go."""
    root = tmp_path / "md"
    engine = ReadsThroughCurrent(root)
    sink = ModelSink(root, engine, 0)
    counts = []

    async def script():
        await write(sink, 1)
        assert await engine.paused.receive() == 1
        await engine.resume_tx.send(None)
        await sink.handoff.wait_delivered(1)
        await write(sink, 2)
        assert await engine.paused.receive() == 2  # stuck here while 3..21 arrive
        for v in range(3, 22):
            await write(sink, v)
            assert sink.dir.current_version() == 2 and sink.version == v
            await pruned(sink)
            counts.append(len(version_dirs(sink.dir)))
        await pruned(sink)
        assert version_dirs(sink.dir) == [1, 2, 21]
        engine.pause = False
        await engine.resume_tx.send(None)
        await sink.handoff.wait_delivered(21)
        await pruned(sink)

    with_handoff(sink, script)
    assert max(counts) == 3, counts
    assert version_dirs(sink.dir) == [21] and sink.dir.current_version() == 21
    assert [v for v, _ in engine.reads] == [1, 2, 21]
    assert all(same_bits(got, state(v)) for v, got in engine.reads)


def _crash_while_current_is_held(root) -> None:
    """Versions 1 (current, its reload stuck), 2 and 3 written (2 superseded, gone), then the process ends."""
    engine = ReadsThroughCurrent(root)
    sink = ModelSink(root, engine, 0)

    async def script():
        await write(sink, 1)
        assert await engine.paused.receive() == 1
        await write(sink, 2)
        await write(sink, 3)

    with_handoff(sink, script)
    assert ModelDir(root).current_version() == 1 and version_dirs(ModelDir(root)) == [1, 3]


def test_at_start_a_newer_version_a_crash_left_is_taken_if_it_is_the_nodes_else_removed(tmp_path):
    """After a crash while `current` was held back: `written` is the current version again
    (no directory above it is a link source). The node's own version there, with its recorded
    version, swarm and state hash, is taken without being written again and switched to
    before the reload; another state under that number is written again; a version the node
    is not at goes at the first write."""
    root = tmp_path / "mine"
    _crash_while_current_is_held(root)
    engine = ReadsThroughCurrent(root, pause=False)
    sink = ModelSink(root, engine, 0)  # the restart: the node resumes at version 3, as applied
    assert sink.version == 1 and sink.dir.written == 1

    async def script():
        await sink.write(weights(3), LAYOUT, None, None)  # at start: the daemon's first write says no changes
        await sink.handoff.wait_delivered(3)

    with_handoff(sink, script)
    assert sink.bytes_written == 0, "version 3 was whole and this node's: taken, not written again"
    assert sink.dir.current_version() == 3 and version_dirs(sink.dir) == [3]
    assert [v for v, _ in engine.reads] == [3] and same_bits(engine.reads[0][1], state(3))

    for name, w in [("other", weights(3, state(33))), ("ahead", weights(4))]:
        root = tmp_path / name
        _crash_while_current_is_held(root)
        sink = ModelSink(root, None, 0)  # restarted without an engine: at another state of 3, or at 4
        trio.run(sink.write, w, LAYOUT, set(LAYOUT), None)
        assert sink.bytes_written > 0 and sink.dir.current_version() == w.version, name
        assert version_dirs(sink.dir) == [w.version] and same_bits(loaded(sink.dir.current), w.state), name


def test_a_switch_that_fails_fails_that_hand_off_only_and_a_newer_version_goes_in(tmp_path):
    """A version whose directory is gone when its reload would start (removed under the node)
    cannot be made current: that hand-off fails with what was expected and what was found,
    the engine is not asked to reload a `current` that does not name it, and the next
    version is switched to and handed over."""
    md = ModelDir(tmp_path / "md")
    engine = ReadsThroughCurrent(md.root, pause=False)
    h = Handoff(engine, hold=md.hold, release=md.release, switch=md.switch)
    md.write(1, state(1), LAYOUT, {}, meta(1, state(1)))

    async def script():
        h.offer(Offer(2, md.path(2), "h2", None))  # never written (or removed since)
        while h.last_error is None:
            await trio.sleep(0.01)
        assert "could not make version 2 current" in h.last_error, h.last_error
        assert "expected version 2 written in" in h.last_error and "found no such directory" in h.last_error
        md.write(3, state(3), LAYOUT, {}, meta(3, state(3)), switch=False)
        h.offer(Offer(3, md.path(3), "h3", None))
        await h.wait_delivered(3)

    with_handoff(h, script)
    assert [v for v, _ in engine.reads] == [3] and same_bits(engine.reads[0][1], state(3))
    assert md.current_version() == 3 and h.last_error is None


def test_versions_the_handoff_releases_are_removed_off_the_event_loop(tmp_path, monkeypatch):
    """The hand-off runs on the event loop, and its release of a version handed over pruned
    that version's directory right there: a directory may hold every shard of the model (a
    patch that touches every tensor rewrites every shard), hundreds of GB to unlink while the
    node serves nobody. Now the sink prunes what the hand-off released in a worker thread."""
    import shutil
    import threading

    from patchswarm.node import modeldir as modeldir_mod

    removed = []  # (version directory's name, removed on the event loop's thread)

    def spy(path, *a, _rmtree=shutil.rmtree, **k):
        removed.append((os.path.basename(path), threading.current_thread() is threading.main_thread()))
        return _rmtree(path, *a, **k)

    monkeypatch.setattr(modeldir_mod.shutil, "rmtree", spy)
    root = tmp_path / "md"
    engine = ReadsThroughCurrent(root, pause=False)
    sink = ModelSink(root, engine, 0)

    async def script():
        for v in range(1, 5):
            await write(sink, v)
            await sink.handoff.wait_delivered(v)
        await pruned(sink)  # the last release's prune runs in a thread

    with_handoff(sink, script)
    assert version_dirs(sink.dir) == [4] and sink.dir.current_version() == 4
    gone = [(name, on_loop) for name, on_loop in removed if name.startswith("v")]
    assert {name for name, _ in gone} == {f"v{v:010d}" for v in (1, 2, 3)}, removed
    assert not any(on_loop for _, on_loop in gone), f"removed on the event loop: {gone}"
