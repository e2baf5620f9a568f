"""The origin's publishing rules, in process: keyframes when due, restarts that continue, interrupted publishes.

No tracker is needed for these (the origin keeps retrying it in the background);
what nodes receive over the wire is covered by tests/test_swarm.py.
"""

from __future__ import annotations

import time

import pytest
import trio

import torch

from patchswarm.node.net import trust
from patchswarm.node.trainer.origin import SyncOrigin
from synthetic import rl_checkpoints, served
from patchswarm.node.weights import WEIGHTS_NAME, read_weights
from patchswarm.protocol.errors import UnsupportedFormat, UsageError
from patchswarm.protocol.patch import apply
from patchswarm.protocol.publication import object_chunk_bytes, patch_of, table_of
from patchswarm.protocol.statehash import state_hash


def make_origin(tmp_path, **kw) -> SyncOrigin:
    swarm = tmp_path / "swarm"
    if not swarm.exists():
        trust.init_swarm(swarm)
        trust.issue(swarm, "origin", "origin", tmp_path / "creds")
    return SyncOrigin(tracker="127.0.0.1:9", creds=tmp_path / "creds", key=swarm / "trainer.key",
                      data_dir=tmp_path / "data", listen="127.0.0.1:0", **kw)


def test_keyframe_first_patches_after_and_a_keyframe_when_the_chain_costs_more(tmp_path):
    states = rl_checkpoints("tiny", 1e-2, 4)  # dense steps: each patch costs most of a keyframe
    with make_origin(tmp_path) as o:
        versions = [o.publish(s) for s in states]
        history = o.stats()["versions"]
    assert versions == list(range(5))
    assert history[0]["patch_bytes"] is None and history[0]["keyframe_bytes"] > 0
    assert all(h["patch_bytes"] > 0 for h in history[1:])
    keyframes = [h["version"] for h in history if h["keyframe_bytes"]]
    assert keyframes[0] == 0 and len(keyframes) >= 2, history
    # each keyframe comes exactly when the patches since the previous one outweigh it:
    # every keyframe was due, and every version whose chain outweighed the last keyframe got one
    last = 0
    for h in history[1:]:
        chain = sum(history[v]["patch_bytes"] for v in range(last + 1, h["version"] + 1))
        due = chain > history[last]["keyframe_bytes"]
        assert bool(h["keyframe_bytes"]) == due, (h["version"], chain, history[last]["keyframe_bytes"])
        if due:
            last = h["version"]


def test_restart_continues_the_version_chain_from_disk(tmp_path):
    states = rl_checkpoints("tiny", 1e-5, 3)
    with make_origin(tmp_path) as o:
        o.publish(states[0])
        o.publish(states[1])
    with make_origin(tmp_path) as o:
        assert o.publish(states[2]) == 2
        store = o.origin.store
        m = store.manifest((2, False))
        base = served(states[1], torch.bfloat16)
        patch = patch_of(m, store.chunks((2, False)), table_of(base))
    apply(base, patch)  # the new patch is against what was published before the restart
    assert state_hash(base) == state_hash(served(states[2], torch.bfloat16))


def test_chunks_grow_with_the_state_so_a_manifest_lists_at_most_max_object_chunks(tmp_path):
    """The origin cuts an object into at most about `max_object_chunks` chunks, doubling
    `chunk_bytes` as the served state needs (at 1 MiB a ~500 GB keyframe would be ~480,000
    chunks, a manifest no wire frame carries); what it cuts still applies bit-exactly."""
    states = rl_checkpoints("tiny", 1e-2, 2)  # dense: the patch is most of a keyframe
    full = sum(t.numel() * t.element_size() for t in served(states[0], torch.bfloat16).values())
    counts = {}
    for cap in (None, 4):
        kw = {"chunk_bytes": 16 << 10, "segment_elements": 1 << 12}
        if cap is not None:
            kw["max_object_chunks"] = cap
        with make_origin(tmp_path / f"cap{cap}", **kw) as o:
            o.publish(states[0])
            o.publish(states[1])
            store = o.origin.store
            keyframe, patch_m = store.manifest((0, True)), store.manifest((1, False))
            patch = patch_of(patch_m, store.chunks((1, False)), table_of(served(states[0], torch.bfloat16)))
        counts[cap] = (len(keyframe.chunks), len(patch_m.chunks))
        if cap is not None:
            # 16 KiB doubled until 4 chunks hold the state; a chunk packs whole segments
            assert object_chunk_bytes(16 << 10, full, 4) * 4 >= full > object_chunk_bytes(16 << 10, full, 4) * 2
            assert max(counts[cap]) <= cap + 1, counts
        base = served(states[0], torch.bfloat16)
        apply(base, patch)
        assert state_hash(base) == state_hash(served(states[1], torch.bfloat16))
    assert counts[None][1] > 2 * counts[4][1], counts  # the default cap left the patch's small chunks alone


def test_interrupted_publish_is_dropped_and_published_again(tmp_path):
    """A crash while version 2's patch was being written: some chunk files, a temporary, no
    manifest (it goes last). The restart drops the object and resumes at version 1."""
    states = rl_checkpoints("tiny", 1e-5, 3)
    with make_origin(tmp_path) as o:
        o.publish(states[0])
        o.publish(states[1])
        o.publish(states[2])
    obj = tmp_path / "data" / "objects" / "v0000000002-patch"
    (obj / "manifest").unlink()
    (obj / ".000001.chunk.999.tmp").write_bytes(b"half")
    with make_origin(tmp_path) as o:
        assert o.origin.version == 1
        assert o.origin.store.manifest((2, False)) is None and not obj.exists()
        assert o.publish(states[2]) == 2
        base = served(states[1], torch.bfloat16)
        patch = patch_of(o.origin.store.manifest((2, False)), o.origin.store.chunks((2, False)), table_of(base))
    apply(base, patch)
    assert state_hash(base) == state_hash(served(states[2], torch.bfloat16))


def test_a_restart_replays_the_base_and_the_patches_after_it(tmp_path):
    """No full write per version: the base is written at the first version and again every
    `compact_every` versions (off the publish path); a restart replays the rest."""
    states = rl_checkpoints("tiny", 1e-5, 6)
    base_file = tmp_path / "data" / WEIGHTS_NAME
    with make_origin(tmp_path, compact_every=4) as o:
        o.publish(states[0])
        assert read_weights(base_file).version == 0
        for s in states[1:4]:
            o.publish(s)
        assert read_weights(base_file).version == 0, "nothing rewritten before compact_every versions"
        o.publish(states[4])  # 4 versions since the base: compaction, in the background
        for _ in range(200):
            if o.origin.durable.base.version == 4:
                break
            time.sleep(0.05)
        assert read_weights(base_file).version == 4
        o.publish(states[5])
        want = o.origin.served.state_hash
    with make_origin(tmp_path, compact_every=4) as o:
        assert o.origin.version == 5 and o.origin.served.state_hash == want
        assert o.origin.served.state_hash == state_hash(served(states[5], torch.bfloat16))


def test_publish_copies_the_trainers_tensors(tmp_path):
    states = rl_checkpoints("tiny", 1e-5, 1)
    live = {k: v.clone() for k, v in states[0].items()}
    ints = {"step": torch.tensor([7], dtype=torch.int64)}  # non-float tensors are served as they are
    with make_origin(tmp_path) as o:
        o.publish({**live, **ints})
        for t in live.values():
            t.add_(1.0)  # the trainer goes on training
        ints["step"].add_(1)
        o.publish({**live, **ints})
        history = o.stats()["versions"]
        step = o.origin.served.state["step"].clone()
    assert history[1]["changed"] > 0
    assert int(step) == 8 and step.dtype == torch.int64


def test_a_state_that_cannot_be_served_publishes_nothing_and_the_next_version_follows(tmp_path):
    """Refused at the origin by name (tests/test_source.py has the rules), not by every node:
    a tensor named like safetensors' metadata would have broken each weights file."""
    states = rl_checkpoints("tiny", 1e-5, 2)
    with make_origin(tmp_path) as o:
        o.publish(states[0])
        with pytest.raises(UsageError, match="'__metadata__'.*reserved"):
            o.publish({**states[1], "__metadata__": torch.zeros(1)})
        with pytest.raises(UnsupportedFormat, match="'s'.*sparse"):
            o.publish({**states[1], "s": torch.zeros(2).to_sparse()})
        assert o.origin.store.manifest((1, False)) is None
        assert o.publish(states[1]) == 1
        base = served(states[0], torch.bfloat16)
        patch = patch_of(o.origin.store.manifest((1, False)), o.origin.store.chunks((1, False)), table_of(base))
    apply(base, patch)
    assert state_hash(base) == state_hash(served(states[1], torch.bfloat16))


def test_a_manifest_no_wire_frame_carries_is_refused_before_anything_is_announced(tmp_path, monkeypatch):
    """A checkpoint of very many tensors and chunks (a 1 TB fp8 MoE: 140k tensors, 400k chunks
    make a 31 MiB keyframe manifest) needs a manifest larger than one wire frame: no
    tracker or peer could take its Announce. Refused when it is signed, with what to change,
    before the version is adopted; then the same version number is published again."""
    from patchswarm.protocol import wire

    states = rl_checkpoints("tiny", 1e-5, 3)
    with make_origin(tmp_path) as o:
        o.publish(states[0])
        size = len(wire.encode(wire.Announce(o.origin.book.envelope((0, True)))))
        # Form 2 lists no tensor of a patch that writes none whole: it travels where form 1 cannot.
        monkeypatch.setattr(wire, "MAX_FRAME_BYTES", size // 4)
        assert o.publish(states[1]) == 1
        m = o.origin.store.manifest((1, False))
        assert m.form == 2 and m.tensors == () and len(wire.encode(wire.Announce(o.origin.book.envelope((1, False))))) <= size // 4
        monkeypatch.setattr(wire, "MAX_FRAME_BYTES", 64)
        with pytest.raises(UsageError, match=r"v2 patch: a signed manifest of [\d,]+ bytes; one wire frame carries"):
            o.publish(states[2])
        assert o.origin.version == 1 and o.origin.store.manifest((2, False)) is None
        monkeypatch.undo()
        assert o.publish(states[2]) == 2 and o.origin.store.manifest((2, False)).form == 1


def test_the_manifest_form_follows_the_tensor_count_unless_one_is_configured(tmp_path, monkeypatch):
    """Form 1, which every member reads, up to FORM1_MAX_TENSORS tensors; form 2 above (a patch
    manifest that grows with the patch); `manifest_form` forces either."""
    import patchswarm.node.trainer.origin as origin_module

    states = rl_checkpoints("tiny", 1e-5, 1)
    tensors = len(served(states[0], torch.bfloat16))

    def forms(name: str, limit: int, **kw) -> set[int]:
        monkeypatch.setattr(origin_module, "FORM1_MAX_TENSORS", limit)
        with make_origin(tmp_path / name, **kw) as o:
            for s in states:
                o.publish(s)
            return {o.origin.store.manifest(k).form for k in o.origin.store.keys()}

    assert forms("below", tensors) == {1}
    assert forms("above", tensors - 1) == {2}
    assert forms("forced-1", tensors - 1, manifest_form=1) == {1}
    assert forms("forced-2", tensors, manifest_form=2) == {2}
    with pytest.raises(UsageError, match="manifest_form: expected 1, 2 or None"):
        make_origin(tmp_path / "bad", manifest_form=3)


def test_watch_publishes_complete_checkpoints_once_across_a_restart(tmp_path):
    """`--watch`: a checkpoint is published once it is in place (a temporary or hidden name is
    not in place yet), an unreadable one is skipped without stopping the watch, and what was
    published or skipped is remembered across a restart (watched.json), so nothing is
    published twice."""
    from safetensors.torch import save_file

    from patchswarm.node.trainer.origin import Origin, OriginConfig

    g = torch.Generator().manual_seed(5)
    states = [{"w": torch.randn(64, 256, generator=g), "b": torch.randn(256, generator=g)} for _ in range(4)]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    swarm = tmp_path / "swarm"
    trust.init_swarm(swarm)
    trust.issue(swarm, "origin", "origin", tmp_path / "creds")
    cfg = OriginConfig(tracker="127.0.0.1:9", creds=tmp_path / "creds", key=swarm / "trainer.key",
                       data_dir=tmp_path / "data", listen="127.0.0.1:0")
    ledger = tmp_path / "data" / "watched.json"

    def watched() -> set:
        import json
        return set(json.loads(ledger.read_text())) if ledger.exists() else set()

    async def watch_until(name: str) -> int | None:
        """Run an origin watching `ckpt` until the ledger holds `name`; its version then."""
        o = Origin(cfg)
        with trio.fail_after(120):
            async with trio.open_nursery() as n:
                await n.start(o.run)
                n.start_soon(o.watch, ckpt)
                while name not in watched():
                    await trio.sleep(0.05)
                n.cancel_scope.cancel()
        return o.version

    save_file(states[0], ckpt / "a.safetensors")
    save_file(states[1], ckpt / "b.safetensors.tmp")  # still being written: not in place
    save_file(states[1], ckpt / ".c.safetensors")  # hidden: a writer's temporary
    (ckpt / "d.safetensors").write_bytes(b"not a safetensors file")
    header = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'  # and 4 bytes no tensor covers
    (ckpt / "d2.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    save_file(states[2], ckpt / "e.safetensors")
    # one pass in name order: a (0), d and d2 skipped, e (1); b.tmp and .c passed over before e
    assert trio.run(watch_until, "e.safetensors") == 1
    assert watched() == {"a.safetensors", "d.safetensors", "d2.safetensors", "e.safetensors"}

    (ckpt / "b.safetensors.tmp").rename(ckpt / "b.safetensors")  # now in place
    save_file(states[3], ckpt / "f.safetensors")
    assert trio.run(watch_until, "f.safetensors") == 3  # b (2), f (3); a and e not again
    assert watched() == {"a.safetensors", "b.safetensors", "d.safetensors", "d2.safetensors", "e.safetensors",
                         "f.safetensors"}


def test_watch_publishes_numbered_checkpoints_in_step_order(tmp_path):
    """The defect: the watch went in plain string order, in which a trainer's unpadded
    checkpoint-1000 comes before checkpoint-500 (Hugging Face Trainer's names): an origin
    that found both published step 1000 first, then step 500 as the newest version."""
    from safetensors.torch import save_file

    from patchswarm.node.trainer.origin import Origin, OriginConfig

    g = torch.Generator().manual_seed(6)
    steps = {500: {"w": torch.randn(8, 16, generator=g)}, 1000: {"w": torch.randn(8, 16, generator=g)}}
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for step, state in steps.items():
        save_file(state, ckpt / f"checkpoint-{step}.safetensors")
    swarm = tmp_path / "swarm"
    trust.init_swarm(swarm)
    trust.issue(swarm, "origin", "origin", tmp_path / "creds")
    cfg = OriginConfig(tracker="127.0.0.1:9", creds=tmp_path / "creds", key=swarm / "trainer.key",
                       data_dir=tmp_path / "data", listen="127.0.0.1:0")

    async def watch() -> Origin:
        o = Origin(cfg)
        with trio.fail_after(120):
            async with trio.open_nursery() as n:
                await n.start(o.run)
                n.start_soon(o.watch, ckpt)
                while o.version != 1:
                    await trio.sleep(0.05)
                n.cancel_scope.cancel()
        return o

    o = trio.run(watch)
    assert o.served.state_hash == state_hash(served(steps[1000], torch.bfloat16))


# ================================================================ trajectory intake and the feed


async def _loop_gaps(done: trio.Event, gaps: list[float], period: float) -> None:
    """Until `done`: sleep `period` at a time and append each turn's wall time to `gaps`, so a
    long stand-still of the event loop shows as one large gap."""
    last = time.perf_counter()
    while not done.is_set():
        await trio.sleep(period)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


def _hold_appends(o, peak: list[int]) -> trio.Event:
    """Make `o`'s trajectory store hold every append until the returned event is set; `peak`
    gets the number of appends waiting, each time one starts."""
    gate, pending, append = trio.Event(), [0], o.trajectory_store.append

    async def held_append(records):
        pending[0] += 1
        peak.append(pending[0])
        await gate.wait()
        try:
            return await append(records)
        finally:
            pending[0] -= 1

    o.trajectory_store.append = held_append
    return gate


def _intake_setup(tmp_path):
    from patchswarm.node.trainer.origin import OriginConfig

    swarm = tmp_path / "swarm"
    trust.init_swarm(swarm)
    trust.issue(swarm, "origin", "origin", tmp_path / "creds")
    trust.issue(swarm, "n1", "node", tmp_path / "n1")
    return OriginConfig(tracker="127.0.0.1:9", creds=tmp_path / "creds", key=swarm / "trainer.key",
                        data_dir=tmp_path / "data", listen="127.0.0.1:0")


async def _dial_as(tmp_path, name: str, addr: str, revisions: list[str] | None = None):
    """A session to the origin as node `name`; `revisions`: what its TLS offers in ALPN
    (None: this version's; ["patchswarm/2"]: a node of the version before TrajectoriesBusy)."""
    from patchswarm.node.net.transport import connect
    from patchswarm.node.net.trust import Credentials, client_context
    from patchswarm.protocol import wire

    creds = Credentials.load(tmp_path / name)
    ctx = client_context(creds)
    if revisions is not None:
        ctx.set_alpn_protocols(revisions)
    return await connect(addr, creds, {"origin"}, wire.Hello(name, "r1", "node", "127.0.0.1:1", []),
                         expect_name="origin", ssl_context=ctx)


OLD_NODE = ["patchswarm/2"]  # the ALPN offer of a node that cannot read TrajectoriesBusy


def test_a_node_that_never_waits_for_acks_gets_backpressure_not_origin_memory(tmp_path):
    """Before: every Trajectories message started its own store task at once, so a node that
    sent batches without waiting for acks (the uploader keeps 4 in flight; a buggy or hostile
    member need not) made the origin hold every batch it sent, decoded, until the disk took
    it: 200 batches, 200 tasks. Now the origin reads a node's next batch only while fewer
    than INTAKE_BATCHES_PER_NODE of its batches wait for the store: the rest waits in the
    node's socket. Every batch is still stored once and acked. (A node of wire revision 2,
    which cannot read a TrajectoriesBusy: it is never sent one.)"""
    from patchswarm.node.trainer.origin import INTAKE_BATCHES_PER_NODE, Origin
    from patchswarm.protocol import wire
    from patchswarm.protocol.trajectory import Record, encode_batch

    cfg = _intake_setup(tmp_path)
    sent = 3 * INTAKE_BATCHES_PER_NODE + 5
    peak = []

    async def main():
        o = Origin(cfg)
        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                await n.start(o.run)
                gate = _hold_appends(o, peak)
                ms = await _dial_as(tmp_path, "n1", o.listen_addr, OLD_NODE)
                for b in range(sent):
                    batch = [Record("n1", "r1", b * 10 + i, 0, 1.0, b"x" * 100) for i in range(10)]
                    await ms.send(wire.Trajectories(encode_batch(batch)))
                await trio.sleep(0.5)  # the origin reads what it will
                held = max(peak)
                gate.set()
                acked = []
                while len(acked) < sent:
                    msg = await ms.receive()
                    assert not isinstance(msg, wire.TrajectoriesBusy)
                    if isinstance(msg, wire.TrajectoriesAck):
                        acked.append(sorted(msg.seqs))
                await ms.aclose()
                n.cancel_scope.cancel()
        return held, acked, o.trajectory_store.summary()

    held, acked, summary = trio.run(main)
    assert held <= INTAKE_BATCHES_PER_NODE
    assert sorted(s for a in acked for s in a) == list(range(sent * 10))
    assert summary["records"] == sent * 10 and summary["duplicates_dropped"] == 0


def test_batches_waiting_for_the_store_are_bounded_across_all_nodes(tmp_path, monkeypatch):
    """Before: the per-node bound held each node to 4 batches, but nothing held the sum:
    a slow disk with N nodes uploading held N x 4 decoded batches (4 MiB each from the
    uploader, up to 12 MiB raw from anyone). Now at most INTAKE_BATCHES_TOTAL wait, and
    a batch is decoded only once it has a slot: the rest wait, as bytes, in the nodes'
    sockets. Here the total is set below the per-node bound and two nodes upload."""
    from patchswarm.node.trainer import origin as origin_mod
    from patchswarm.protocol import wire
    from patchswarm.protocol.trajectory import Record, encode_batch

    monkeypatch.setattr(origin_mod, "INTAKE_BATCHES_TOTAL", 3)
    cfg = _intake_setup(tmp_path)
    trust.issue(tmp_path / "swarm", "n2", "node", tmp_path / "n2")
    peak, decoded = [], [0]
    decode = origin_mod.decode_batch

    def counting_decode(*args):
        decoded[0] += 1
        return decode(*args)

    monkeypatch.setattr(origin_mod, "decode_batch", counting_decode)

    async def main():
        o = origin_mod.Origin(cfg)
        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                await n.start(o.run)
                gate = _hold_appends(o, peak)
                streams = [await _dial_as(tmp_path, name, o.listen_addr, OLD_NODE) for name in ("n1", "n2")]
                for ms in streams:
                    for b in range(4):
                        await ms.send(wire.Trajectories(encode_batch(
                            [Record("n1" if ms is streams[0] else "n2", "r1", b, 0, 1.0, b"x")])))
                await trio.sleep(0.5)
                held, decoded_then = max(peak), decoded[0]
                gate.set()
                for ms in streams:
                    acks = 0
                    while acks < 4:
                        msg = await ms.receive()
                        assert not isinstance(msg, wire.TrajectoriesBusy)
                        acks += isinstance(msg, wire.TrajectoriesAck)
                    await ms.aclose()
                n.cancel_scope.cancel()
        return held, decoded_then, o.trajectory_store.summary()["records"]

    held, decoded_then, records = trio.run(main)
    assert held <= 3 and decoded_then <= 3
    assert records == 8


def test_a_node_of_revision_3_finding_no_slot_is_told_busy_and_its_chunk_requests_are_answered(tmp_path, monkeypatch):
    """Before: a batch that found no intake slot stopped the origin reading the node's
    connection until the store freed one, and the same connection carries the node's chunk
    requests: with the store held (slow, or DiskFull: `_store` retries while holding the
    slots) a node asked for a chunk in vain. Now a node of wire revision 3 gets a
    TrajectoriesBusy for each batch that finds no slot (dropped, unstored) and its next
    request is answered while the store is still held; the batches that got a slot are
    acked once it lets go, the refused ones once sent again, each record stored once."""
    from patchswarm.node.trainer import origin as origin_mod
    from patchswarm.protocol import wire
    from patchswarm.protocol.trajectory import Record, encode_batch

    monkeypatch.setattr(origin_mod, "INTAKE_BATCHES_TOTAL", 2)  # what >16 nodes make of the 64
    cfg = _intake_setup(tmp_path)
    peak = []

    def batch(b):
        return wire.Trajectories(encode_batch([Record("n1", "r1", b * 10 + i, 0, 1.0, b"x" * 100) for i in range(10)]))

    async def main():
        o = origin_mod.Origin(cfg)
        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                await n.start(o.run)
                version = await o.publish({"w": torch.arange(4096, dtype=torch.float32)})
                total = o.store.manifest((version, True)).chunks[0][0]
                gate = _hold_appends(o, peak)
                ms = await _dial_as(tmp_path, "n1", o.listen_addr)
                assert wire.revision(ms.wire_revision) >= 3  # this version: deferrals
                for b in range(4):  # the uploader's window: two find a slot, two do not
                    await ms.send(batch(b))
                await ms.send(wire.Request(version, True, 0))
                print("published", flush=True); busy, acked, got = [], [], 0
                with trio.fail_after(10):  # before: nothing came back while the store held
                    while got < total:
                        msg = await ms.receive()
                        busy += [msg] if isinstance(msg, wire.TrajectoriesBusy) else []
                        acked += [msg] if isinstance(msg, wire.TrajectoriesAck) else []
                        got += len(msg.data) if isinstance(msg, wire.Piece) else 0
                held_then, acked_then = max(peak), len(acked)
                gate.set()
                while len(acked) < 2:
                    msg = await ms.receive()
                    acked += [msg] if isinstance(msg, wire.TrajectoriesAck) else []
                # As the uploader does: the refused batches again (its spool kept them), each
                # answered once, until every one is acked.
                for _ in range(50):
                    todo = [b for b in (2, 3) if b * 10 not in {s for m in acked for s in m.seqs}]
                    if not todo:
                        break
                    for b in todo:
                        await ms.send(batch(b))
                    for _ in todo:
                        msg = await ms.receive()
                        while not isinstance(msg, (wire.TrajectoriesAck, wire.TrajectoriesBusy)):
                            msg = await ms.receive()
                        acked += [msg] if isinstance(msg, wire.TrajectoriesAck) else []
                    await trio.sleep(0.05)
                await ms.aclose()
                n.cancel_scope.cancel()
        return busy, held_then, acked_then, acked, o

    busy, held_then, acked_then, acked, o = trio.run(main)
    assert [m.retry_ms for m in busy] == [origin_mod.DEFER_RETRY_MS] * 2 and held_then <= 2 and acked_then == 0
    assert sorted(s for m in acked for s in m.seqs) == list(range(40))
    summary = o.trajectory_store.summary()
    assert summary["records"] == 40 and summary["duplicates_dropped"] == 0
    assert o.intake_deferred == 2


def test_the_feed_takes_odd_arguments_by_name_and_none_waits_without_limit(tmp_path):
    """Before: get_batch(-1) and get_batch(2.5) returned [] and 3 records, timeout=-1, nan
    and None raised trio's ValueError or a TypeError from deep inside, and
    max_staleness="2" or -1 was taken (a TypeError at the first read once a version was
    out; -1 counted every record stale). Now: n is an int >= 0 (0: [] at once), timeout
    a number >= 0 or None (no limit, as queue.Queue.get), inf too; max_staleness and
    min_version ints >= 0 or None; anything else a UsageError saying what was found."""
    import math
    import threading

    from patchswarm.protocol.trajectory import Record

    with make_origin(tmp_path) as o:
        trio.from_thread.run(o.origin.trajectory_store.append,
                             [Record("n1", "r1", i, 0, 1.0, b"x") for i in range(3)], trio_token=o._token)
        feed = o.trajectories()
        for n, timeout in ((-1, 1), (2.5, 1), (True, 1), ("3", 1), (3, -1), (3, math.nan), (3, "1")):
            with pytest.raises(UsageError, match="get_batch"):
                feed.get_batch(n, timeout=timeout)
        for kw in ({"max_staleness": -1}, {"max_staleness": "2"}, {"max_staleness": 1.5}, {"min_version": -3}):
            with pytest.raises(UsageError, match=next(iter(kw))):
                o.trajectories(**kw)
        t0 = time.monotonic()
        assert feed.get_batch(0, timeout=30) == [] and time.monotonic() - t0 < 5
        assert len(feed.get_batch(2, timeout=0)) == 2
        for timeout, n, seq, want in ((None, 2, 3, [2, 3]), (math.inf, 1, 4, [4])):  # both wait for n
            got = []
            waiter = threading.Thread(target=lambda: got.append(feed.get_batch(n, timeout=timeout)))
            waiter.start()
            time.sleep(0.3)
            assert waiter.is_alive()
            trio.from_thread.run(o.origin.trajectory_store.append, [Record("n1", "r1", seq, 0, 1.0, b"x")],
                                 trio_token=o._token)
            waiter.join(10)
            assert [r.seq for r in got[0]] == want


def test_a_feed_after_close_or_during_it_raises_a_usage_error(tmp_path):
    """Before: a get_batch waiting while another thread closed the origin raised
    trio.Cancelled in the trainer's thread (a BaseException no `except Exception` catches),
    and every call after close raised trio.RunFinishedError. Now both are a UsageError
    saying the origin is closed."""
    import threading

    with make_origin(tmp_path) as o:
        feed = o.trajectories()
        errors = []

        def wait():
            try:
                feed.get_batch(10, timeout=30)
            except BaseException as e:  # what the trainer's thread sees
                errors.append(e)

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.3)
    waiter.join(10)
    assert not waiter.is_alive()
    assert [type(e) for e in errors] == [UsageError] and "closed" in str(errors[0])
    for call in (lambda: feed.get_batch(1, timeout=0), o.trajectories, o.stats, lambda: o.publish({})):
        with pytest.raises(UsageError, match="closed"):
            call()


def test_a_restarted_trainer_resumes_its_feed_where_it_stopped_and_reads_each_record_once(tmp_path):
    """Before: a feed always began at the first record ever stored, and its position was
    not to be had, so a trainer restarted with the origin read every record it had already
    trained on again (the store's exactly-once ended at the trainer). Now `feed.position`
    is a plain value to save with the trainer's checkpoint, and
    `origin.trajectories(start=position)` goes on from there, across origin restarts."""
    from patchswarm.protocol.trajectory import Record

    def add(o, seqs):
        trio.from_thread.run(o.origin.trajectory_store.append, [Record("n1", "r1", i, 0, 1.0, b"x") for i in seqs],
                             trio_token=o._token)

    with make_origin(tmp_path) as o:
        add(o, range(5))
        feed = o.trajectories()
        assert [r.seq for r in feed.get_batch(3, timeout=0)] == [0, 1, 2]
        saved = feed.position
    with make_origin(tmp_path) as o:
        add(o, range(3, 8))  # a node's resend of 3 and 4 after the restart, and new ones
        feed = o.trajectories(start=saved)
        assert [r.seq for r in feed.get_batch(100, timeout=0)] == [3, 4, 5, 6, 7]
        assert [r.seq for r in o.trajectories().get_batch(100, timeout=0)] == list(range(8))  # from the start
        for bad in ((1,), ("1", 16), (1, -5), (-1, 16), 7):
            with pytest.raises(UsageError, match="start"):
                o.trajectories(start=bad)


def test_a_get_batch_cancelled_from_outside_delivers_nothing_and_moves_no_position(tmp_path):
    """The records a cancelled get_batch had read never reach the caller: the feed's
    position stays where it was, so a saved position loses none of them."""
    from patchswarm.node.trainer.origin import Origin
    from patchswarm.protocol.trajectory import Record

    cfg = _intake_setup(tmp_path)

    async def main():
        o = Origin(cfg)
        async with trio.open_nursery() as n:
            await n.start(o.run)
            await o.publish({"w": torch.zeros(4)})  # version 0
            await o.trajectory_store.append([Record("n1", "r1", i, 0, 1.0, b"x") for i in range(3)])
            await o.trajectory_store.append([Record("n1", "r1", 9, 7, 1.0, b"x")])  # of a version not published
            feed = o.trajectories(max_staleness=1)
            with trio.move_on_after(0.2):
                await feed.get_batch(10, timeout=30)  # reads 3, waits for 7 more; cancelled
            assert feed.ahead == 0  # what it skipped is counted when it is read again
            assert [r.seq for r in await feed.get_batch(10, timeout=0)] == [0, 1, 2] and feed.ahead == 1
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_batch_the_store_refuses_drops_the_node_with_a_line_and_the_origin_stays_up(tmp_path, monkeypatch, caplog):
    """A batch over the store's budget (here: seqs leaving too many gaps) is not acked;
    the node is dropped with one line saying why, and the origin goes on: the node's
    next connection is taken, and its well-formed batches are stored."""
    from patchswarm.node.trainer import trajstore
    from patchswarm.node.trainer.origin import Origin
    from patchswarm.protocol import wire
    from patchswarm.protocol.trajectory import Record, encode_batch

    monkeypatch.setattr(trajstore, "MAX_SEQ_RANGES_PER_NODE", 4)
    cfg = _intake_setup(tmp_path)

    def batch(seqs):
        return wire.Trajectories(encode_batch([Record("n1", "r1", s, 0, 1.0, b"x") for s in seqs]))

    async def first_reply(ms):
        with trio.fail_after(10):
            try:
                return await ms.receive()
            except (wire.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return None

    async def main():
        o = Origin(cfg)
        async with trio.open_nursery() as n:
            await n.start(o.run)
            ms = await _dial_as(tmp_path, "n1", o.listen_addr)
            await ms.send(batch(range(0, 20, 2)))  # 10 ranges
            assert await first_reply(ms) is None  # closed, no ack
            await ms.aclose()
            ms = await _dial_as(tmp_path, "n1", o.listen_addr)
            await ms.send(batch(range(100)))
            reply = await first_reply(ms)
            await ms.aclose()
            n.cancel_scope.cancel()
        return reply, [r.seq for r in o.trajectory_store.iter_records()]

    reply, stored = trio.run(main)
    assert isinstance(reply, wire.TrajectoriesAck) and sorted(reply.seqs) == list(range(100))
    assert stored == list(range(100))
    assert any("n1" in r.getMessage() and "ranges" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def test_an_async_feed_waiting_without_limit_hears_that_the_origin_stopped(tmp_path):
    """Before: a get_batch(timeout=None) from a task beside the origin (the async API) waited
    for ever once the origin stopped: nothing would ever wake it. Now it raises UsageError
    when the store closes, and so does a get_batch that starts after (and a feed asked of
    an origin not started yet, an AttributeError before)."""
    from patchswarm.node.trainer.origin import Origin
    from patchswarm.protocol.errors import UsageError as Usage

    cfg = _intake_setup(tmp_path)
    errors = []
    with pytest.raises(Usage, match="not started"):  # before: AttributeError on None
        Origin(cfg).trajectories()

    async def main():
        o = Origin(cfg)
        with trio.fail_after(20):
            async with trio.open_nursery() as outer:
                async with trio.open_nursery() as n:
                    await n.start(o.run)
                    feed = o.trajectories()

                    async def consume():
                        try:
                            await feed.get_batch(10, timeout=None)
                        except Usage as e:
                            errors.append(e)

                    outer.start_soon(consume)
                    await trio.sleep(0.2)
                    n.cancel_scope.cancel()  # the origin stops; the consumer lives on
                await trio.sleep(0.2)
                with pytest.raises(Usage, match="closed"):
                    await feed.get_batch(1, timeout=None)

    trio.run(main)
    assert len(errors) == 1 and "closed" in str(errors[0])


def test_a_heavy_batch_is_decoded_beside_the_event_loop_not_on_it(tmp_path):
    """Before: the origin decoded each upload on its event loop, and a batch of records
    whose meta is 64 KiB of empty containers takes seconds to check (4.3 s for one of 193
    records, 50 KB on the wire): every other node's intake, chunk serving and the tracker
    link stood still meanwhile. Now it is decoded in a worker thread (and its meta kept
    as bytes): the loop goes on ticking."""
    from patchswarm.node.trainer.origin import Origin
    from patchswarm.protocol import wire
    from patchswarm.protocol.trajectory import Record, decode_batch, encode_batch

    cfg = _intake_setup(tmp_path)
    meta = {"a": [[] for _ in range(64000)]}
    data = encode_batch([Record("n1", "r1", i, 0, 1.0, b"", meta) for i in range(16)])
    t0 = time.perf_counter()
    decode_batch(data)
    decode_s = time.perf_counter() - t0

    async def main():
        o = Origin(cfg)
        gaps = []
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                await n.start(o.run)
                ms = await _dial_as(tmp_path, "n1", o.listen_addr)
                done = trio.Event()
                n.start_soon(_loop_gaps, done, gaps, 0.01)
                await ms.send(wire.Trajectories(data))
                while not isinstance(await ms.receive(), wire.TrajectoriesAck):
                    pass
                await trio.sleep(0.05)  # the ticker records the gap, if there was one
                done.set()
                await ms.aclose()
                n.cancel_scope.cancel()
        return max(gaps), o

    worst, o = trio.run(main)
    assert worst < max(0.1, decode_s / 3), (worst, decode_s)


def test_one_feed_serves_one_get_batch_at_a_time(tmp_path):
    """Two get_batch calls on one feed at once shared its cursor: a cancelled one put the
    position back over records the other had delivered, which then came again. Now the
    second call raises UsageError (two feeds are two cursors, and each may be used)."""
    from patchswarm.node.trainer.origin import Origin
    from patchswarm.protocol.errors import UsageError as Usage

    cfg = _intake_setup(tmp_path)

    async def main():
        o = Origin(cfg)
        async with trio.open_nursery() as n:
            await n.start(o.run)
            feed = o.trajectories()
            n.start_soon(feed.get_batch, 5, 30)
            await trio.sleep(0.1)
            with pytest.raises(Usage, match="another get_batch"):
                await feed.get_batch(1, timeout=0)
            assert await o.trajectories().get_batch(1, timeout=0) == []  # another feed is fine
            n.cancel_scope.cancel()

    trio.run(main)


def test_get_batch_reads_the_store_beside_the_event_loop(tmp_path, monkeypatch):
    """Before: get_batch read and decoded the store's files on the origin's event loop
    (~1 ms per MB from the page cache, more from a disk): a trainer taking 256 records of
    1 MiB held every node's intake and chunk serving for a quarter second per step. Now
    the cursor reads in a worker thread. Checked by the thread each read ran on, not by
    the loop's gaps, which a loaded machine stretches either way."""
    import threading

    from patchswarm.node.trainer.origin import Origin
    from patchswarm.node.trainer.trajstore import TrajectoryCursor
    from patchswarm.protocol.trajectory import Record

    cfg = _intake_setup(tmp_path)
    readers = []
    read = TrajectoryCursor.read

    def recorded(self, *args, **kwargs):
        readers.append(threading.get_ident())
        return read(self, *args, **kwargs)

    monkeypatch.setattr(TrajectoryCursor, "read", recorded)

    async def main():
        o = Origin(cfg)
        async with trio.open_nursery() as n:
            await n.start(o.run)
            for b in range(8):
                await o.trajectory_store.append([Record("n1", "r1", b * 8 + i, 0, 1.0, bytes(2 << 20)) for i in range(8)])
            got = await o.trajectories().get_batch(64, timeout=30)
            n.cancel_scope.cancel()
        return len(got)

    assert trio.run(main) == 64
    assert readers and threading.get_ident() not in readers, readers  # trio.run's loop runs on this thread


def test_the_origins_own_large_manifests_are_verified_off_the_event_loop(tmp_path):
    """The origin's book verifies the manifests it signs before it takes them: a 140,000-tensor
    keyframe's took 0.47 s of its event loop (chunk serving, trajectory intake, the tracker
    link stood still). One of 4 KiB or more now goes through ManifestCheck's thread; a small
    one stays inline."""
    from patchswarm.node.trainer.origin import Origin

    cfg = _intake_setup(tmp_path)

    async def main():
        o = Origin(cfg)
        async with trio.open_nursery() as n:
            await n.start(o.run)
            await o.publish({"w": torch.zeros(4)})
            assert len(o.book.envelope((0, True))) < 4096 and o.manifest_check.off_loop == 0  # inline
            await o.publish({f"layer.{i:05d}.w": torch.zeros(4) for i in range(500)})  # 500 rows in its table
            big = [k for k in o.book.keys() if k[0] == 1 and len(o.book.envelope(k)) >= 4096]
            assert big and o.manifest_check.off_loop == len(big)
            n.cancel_scope.cancel()

    trio.run(main)
