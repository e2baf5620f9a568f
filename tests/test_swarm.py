"""The swarm end to end, as real processes on loopback: tracker, origin (--watch), nodes.

Every node must reach every version bit-exactly; late joiners catch up; a
node killed mid-download converges after a restart; a tracker killed and
restarted rebuilds its state from the members' re-announcements; members without valid
credentials are refused; lying peers and foreign manifests are rejected and
counted; and nodes take most bytes from each other, not from the origin.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import msgpack
import pytest
import torch
import trio

from patchswarm.node.net import trust
from synthetic import rl_checkpoints, served
from patchswarm.node.net.transport import connect
from patchswarm.protocol import wire
from patchswarm.protocol.manifest import Manifest, decode_manifest, sign_manifest
from swarmlab import SwarmLab, load_weights, same_bits, write_checkpoint

pytestmark = pytest.mark.slow  # real processes

# Small pieces so that even the test model's patches span several chunks.
ORIGIN_ARGS = ["--chunk-bytes", "32768", "--segment-elements", "65536"]


@pytest.fixture(scope="module")
def checkpoints():
    """fp32 master states of 7 consecutive RL steps of the small model (lr 1e-5)."""
    return rl_checkpoints("small", 1e-5, 6)


def served_bf16(state):
    return served(state, torch.bfloat16)


def publish(lab: SwarmLab, watch, states, index: int) -> None:
    write_checkpoint(watch, f"step{index:04d}.safetensors", states[index])


def announced_bytes(origin, version: int) -> int:
    m = re.search(rf"published version {version} \(patch ([\d,]+) B", origin.text())
    assert m, origin.text()[-2000:]
    return int(m.group(1).replace(",", ""))


def test_every_node_gets_every_version_bit_exactly_and_mostly_from_peers(tmp_path, checkpoints):
    watch = tmp_path / "watch"
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        origin = lab.start_origin(region="r0", watch=watch, extra=ORIGIN_ARGS, wait=False)
        nodes = lab.start_nodes([(f"n{i}", f"r{i % 2}") for i in range(8)], starting=[origin])
        origin_in = []
        for v in range(5):
            publish(lab, watch, checkpoints, v)
            statuses = lab.wait_version(nodes, v, timeout=120)
            expect = served_bf16(checkpoints[v])
            for p, st in zip(nodes, statuses):
                assert st["version"] == v
                assert same_bits(load_weights(p), expect), f"{p.name} differs from version {v}"
            origin_in.append(sum(p.status()["bytes_in"]["origin"] for p in nodes))
        # Patches (versions 1-4): the origin sent less than half of what a star would.
        patch_bytes = sum(announced_bytes(origin, v) for v in range(1, 5))
        from_origin = origin_in[-1] - origin_in[0]
        assert from_origin < 0.5 * len(nodes) * patch_bytes, (from_origin, patch_bytes)
        # Each node got most of its patch bytes from peers.
        st = [p.status() for p in nodes]
        assert all(s["chunks_rejected"] == 0 for s in st)
        assert sum(s["bytes_in"]["same_region"] + s["bytes_in"]["other_region"] for s in st) > from_origin

        # A node that joins after five versions catches up.
        publish(lab, watch, checkpoints, 5)
        lab.wait_version(nodes, 5)
        late = lab.start_node("late", region="r1")
        (status,) = lab.wait_version([late], 5, timeout=120)
        assert status["version"] == 5
        assert same_bits(load_weights(late), served_bf16(checkpoints[5]))

        # `patchswarm status`, as people and scripts use it.
        js = json.loads(lab._cli("status", "--data-dir", late.data_dir, "--json"))
        assert {"node_id", "region", "version", "state_hash", "base_path", "latest_version", "peers",
                "bytes_in", "bytes_out", "chunks_rejected", "spool"} <= set(js)
        assert js["node_id"] == "late" and js["version"] == 5 and js["latest_version"] == 5
        assert set(js["bytes_in"]) == {"origin", "same_region", "other_region"}
        assert all({"id", "region"} <= set(p) for p in js["peers"]) and js["peers"]
        table = lab._cli("status", "--socket", late.socket)
        assert "node late (r1)" in table and "same region" in table and js["state_hash"][:20] in table

        # Logs: a line per event that matters, no tracebacks.
        for p in nodes:
            text = p.text()
            assert "joined the swarm via tracker" in text and "Traceback" not in text, p.name
            for v in range(6):
                kind = "keyframe" if v == 0 else "patch"
                assert re.search(rf"applied version {v} \({kind}, [\d,]+ bytes\) in [\d.]+ s", text), (p.name, v)


def test_chunks_are_relayed_while_they_still_arrive(tmp_path, checkpoints):
    """1 MiB chunks (64 KiB parts) into nodes held to 3 MB/s each: a chunk takes a third of
    a second to arrive, so neighbours that hear Incoming follow it, and the version lands
    bit-exactly everywhere."""
    watch = tmp_path / "watch"
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        origin = lab.start_origin(region="r0", watch=watch, extra=["--chunk-bytes", str(1 << 20)], wait=False)
        nodes = lab.start_nodes([(f"n{i}", "r0" if i == 0 else "r1") for i in range(4)], starting=[origin],
                                extra=["--download-limit", "3M"])
        publish(lab, watch, checkpoints, 0)
        statuses = lab.wait_version(nodes, 0, timeout=120)
        for p in nodes:
            assert same_bits(load_weights(p), served_bf16(checkpoints[0])), p.name
        assert all(st["chunks_rejected"] == 0 for st in statuses)
        relayed = {p.name: p.status()["bytes_out_arriving"] for p in nodes}
        assert sum(relayed.values()) >= 1 << 20, relayed  # at least a chunk's worth
        table = lab._cli("status", "--socket", nodes[max(range(4), key=lambda i: relayed[nodes[i].name])].socket)
        assert "relayed while arriving" in table
        for p in nodes:
            assert "Traceback" not in p.text(), p.name


def test_a_joiner_keeps_the_keyframe_it_joined_through_so_the_next_joiner_needs_no_origin(tmp_path, checkpoints):
    """Nodes running when a keyframe comes out fetch that version's patch, never the keyframe;
    a node that joined through it keeps it, and the patches after it, past its 4-version
    window, so a node joining later takes them from it: here with the origin gone. (Before,
    the joiner dropped the keyframe 4 versions on and the next joiner waited for the origin.)"""
    g = torch.Generator().manual_seed(11)
    noise = {n: torch.randn(t.shape, generator=g) for n, t in checkpoints[0].items()}
    half = {n: torch.where(torch.rand(t.shape, generator=g) < 0.5, t, noise[n]) for n, t in checkpoints[0].items()}
    # Half the elements change at version 1 and the other half at 2: each patch costs less than a
    # keyframe, the two together more, so version 2 comes with a keyframe its running nodes skip.
    states = [noise, half, *checkpoints[:6]]  # versions 0-7: at 7 the joiner's window of 4 is past 2
    last = len(states) - 1
    watch = tmp_path / "watch"
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        origin = lab.start_origin(region="r0", watch=watch, extra=ORIGIN_ARGS, wait=False)
        (first,) = lab.start_nodes([("first", "r0")], starting=[origin])
        for versions in ([0], [1], [2, 3]):  # from version 1, patch 2 is first's cheaper path to 3
            for v in versions:
                publish(lab, watch, states, v)
            lab.wait_version([first], versions[-1])
        assert re.search(r"published version 2 \(patch [\d,]+ B, keyframe [\d,]+ B", origin.text()), origin.text()
        assert re.search(r"applied version 2 \(patch", first.text())
        joiner = lab.start_node("joiner", region="r1")
        lab.wait_version([joiner], 3)
        assert re.search(r"applied version 2 \(keyframe", joiner.text())
        for v in range(4, len(states)):
            publish(lab, watch, states, v)
        lab.wait_version([first, joiner], last)
        assert joiner.status()["kept_keyframe"] == 2 and first.status()["kept_keyframe"] is None
        assert "v2's keyframe and the patches after it, kept" in lab._cli("status", "--socket", joiner.socket)
        assert (joiner.data_dir / "objects" / "v0000000002-keyframe").is_dir()
        lab.kill(origin, signal.SIGTERM)
        late = lab.start_node("late", region="r1")
        (st,) = lab.wait_version([late], last, timeout=60)
        assert same_bits(load_weights(late), served_bf16(states[last]))
        assert re.search(r"applied version 2 \(keyframe", late.text())
        assert st["bytes_in"]["origin"] == 0 and st["bytes_in"]["same_region"] > 0, st["bytes_in"]


def test_node_killed_mid_download_restarts_and_converges(tmp_path, checkpoints):
    watch = tmp_path / "watch"
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        origin = lab.start_origin(watch=watch, extra=ORIGIN_ARGS)
        helper = lab.start_node("helper")
        publish(lab, watch, checkpoints, 0)
        lab.wait_version([helper], 0)
        # 4.5 MB keyframe (4 chunks) at 600 kB/s: the kill lands once a chunk is in, the rest not
        slow = lab.start_node("slow", extra=["--download-limit", "600k"])
        announced = lab.wait_log(slow, r"version 0 announced: keyframe, (\d+) chunks, ([\d,]+) bytes")
        chunks, keyframe_bytes = int(announced.group(1)), int(announced.group(2).replace(",", ""))
        stored = slow.data_dir / "objects" / "v0000000000-keyframe"
        deadline = time.monotonic() + 60
        while not sum((before := slow.status())["bytes_in"].values()):
            assert time.monotonic() < deadline, f"no chunk arrived in 60 s: {before}"
            time.sleep(0.05)
        on_disk = len(list(stored.glob("*.chunk")))
        lab.kill(slow, signal.SIGKILL)
        assert before["version"] is None and 0 < on_disk < chunks, (before, on_disk)
        slow.args = [a for a in slow.args if a not in ("--download-limit", "600k")]
        lab.restart(slow)
        (st,) = lab.wait_version([slow], 0)
        # the restart kept what had arrived (every kept chunk whole) and fetched only the rest
        assert 0 < sum(st["bytes_in"].values()) < keyframe_bytes, (st["bytes_in"], keyframe_bytes)
        assert "dropped from the object store" not in slow.text()
        publish(lab, watch, checkpoints, 1)
        (st,) = lab.wait_version([slow], 1)
        assert st["version"] == 1
        assert same_bits(load_weights(slow), served_bf16(checkpoints[1]))
        del origin


def test_a_chunk_whose_sender_dies_part_way_is_finished_from_the_next_holder_not_fetched_again(tmp_path, checkpoints):
    """Issue 26: a node whose source is killed in the middle of a chunk keeps the bytes that
    arrived and asks the next holder for the rest only (RequestRest); its log names the byte
    it resumed from, and the version lands bit-exactly."""
    watch = tmp_path / "watch"
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        lab.start_origin(region="r0", watch=watch, extra=["--chunk-bytes", str(1 << 20)])
        # src sends at 1 MB/s: a 1 MiB chunk takes about a second, so a kill half a second
        # after one chunk arrives whole lands half-way through the next (sent one after another).
        src = lab.start_node("src", region="r0", extra=["--upload-limit", "1M"])
        publish(lab, watch, checkpoints, 0)
        lab.wait_version([src], 0)
        late = lab.start_node("late", region="r1", extra=["-v"])  # r0's member src is its upstream
        lab.wait_log(late, r"DEBUG chunk \d+ of v0 keyframe from src ", timeout=120)
        time.sleep(0.5)
        lab.kill(src, signal.SIGKILL)
        (st,) = lab.wait_version([late], 0)
        assert same_bits(load_weights(late), served_bf16(checkpoints[0]))
        resumed = re.findall(r"request chunk (\d+) of v0 keyframe from (\S+) from byte ([\d,]+)", late.text())
        assert resumed and all(int(b.replace(",", "")) > 0 for _, _, b in resumed), late.text()[-3000:]
        assert st["chunks_rejected"] == 0 and "Traceback" not in late.text()


def test_upload_and_download_limits_hold_between_real_processes(tmp_path, checkpoints):
    """The origin at --upload-limit 1M, then a node at --download-limit 1M: each moves its
    bytes no faster than the limit allows (bytes past the quarter-second burst at the rate).
    The elapsed times bracket the transfers from outside, so load can only lengthen them."""
    rate, burst = 1e6, 250e3
    watch = tmp_path / "watch"
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        lab.start_origin(watch=watch, extra=[*ORIGIN_ARGS, "--upload-limit", "1M"])
        first = lab.start_node("first")
        lab.wait_log(first, "joined the swarm via tracker")
        t0 = time.monotonic()
        publish(lab, watch, checkpoints, 0)
        lab.wait_version([first], 0)
        up_s = time.monotonic() - t0
        from_origin = first.status()["bytes_in"]["origin"]

        second = lab.start_node("second", extra=["--download-limit", "1M"])
        t0 = time.monotonic()
        lab.wait_version([second], 0)
        down_s = time.monotonic() - t0
        received = sum(second.status()["bytes_in"].values())
        print(f"origin upload: {from_origin:,} B in {up_s:.2f} s; node download: {received:,} B in {down_s:.2f} s")
        assert from_origin > 4 * burst and received > 4 * burst  # the keyframe: megabytes
        assert up_s >= (from_origin - burst) / rate, (from_origin, up_s)
        assert down_s >= (received - burst) / rate, (received, down_s)
        assert same_bits(load_weights(second), served_bf16(checkpoints[0]))


def test_tracker_restart_is_soft_state_members_reannounce_and_versions_flow(tmp_path, checkpoints):
    watch = tmp_path / "watch"
    with SwarmLab(tmp_path) as lab:
        tracker = lab.start_tracker()
        origin = lab.start_origin(watch=watch, extra=ORIGIN_ARGS, wait=False)
        a, b = lab.start_nodes([("a", "r1"), ("b", "r2")], starting=[origin])
        publish(lab, watch, checkpoints, 0)
        lab.wait_version([a, b], 0)
        # The tracker keeps nothing on disk: kill it and bring it back on the same address.
        tracker.args = [tracker.addr if str(x).endswith(":0") else x for x in tracker.args]
        lab.kill(tracker, signal.SIGKILL)
        lab.restart(tracker)
        assert lab.tracker_addr == tracker.addr
        # Members reconnect and re-announce; what the origin publishes next reaches them,
        # and a member that joins only now learns the latest version and its peers.
        publish(lab, watch, checkpoints, 1)
        late = lab.start_node("late", region="r1")
        for st in lab.wait_version([a, b, late], 1):
            assert st["version"] == 1
        for p in (a, b, late):
            assert same_bits(load_weights(p), served_bf16(checkpoints[1])), p.name
        assert {"a", "b", "origin"} <= {peer["id"] for peer in late.status()["peers"]}
        assert "Traceback" not in tracker.text()


def test_members_without_valid_credentials_are_refused(tmp_path, checkpoints):
    watch = tmp_path / "watch"
    with SwarmLab(tmp_path) as lab:
        tracker = lab.start_tracker()
        lab.start_origin(watch=watch, extra=ORIGIN_ARGS)
        # Credentials from another swarm's CA.
        trust.init_swarm(tmp_path / "rogue-swarm")
        rogue_creds = tmp_path / "rogue-creds"
        trust.issue(tmp_path / "rogue-swarm", "intruder", "node", rogue_creds)
        intruder = lab.start_node("intruder", creds=rogue_creds)
        publish(lab, watch, checkpoints, 0)
        lab.wait_log(intruder, r"tracker \S+ unreachable", timeout=60)
        lab.wait_log(tracker, r"refused a connection", timeout=60)
        time.sleep(1.0)
        st = intruder.status()
        assert st["version"] is None and not st["tracker_connected"]
        assert "intruder joined" not in tracker.text()


def _rogue_manifest() -> bytes:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    m = Manifest(swarm_id="sw-whatever", version=99, base_version=None, base_hash=None,
                 target_hash="blake3:" + "00" * 32, tensors=[], chunks=[], codec={"format": 1}, created_at=0.0)
    return sign_manifest(m, Ed25519PrivateKey.generate())


def _chunk_size(data_dir: Path, version: int, chunk: int) -> int:
    """The size a manifest the victim holds gives chunk `chunk` of the patch of `version`."""
    envelope = (data_dir / "objects" / f"v{version:010d}-patch" / "manifest").read_bytes()
    return decode_manifest(msgpack.unpackb(envelope)[0]).chunks[chunk][0]


async def _lying_peer(creds_dir, victim_addr: str, victim_dir: Path, region: str, stop_after: float) -> dict:
    """A member with valid credentials that claims every chunk of version 1 and serves
    garbage of the right size (so the victim's hash check is what catches it)."""
    creds = trust.Credentials.load(creds_dir)
    hello = wire.Hello(creds.name, region, "node", "127.0.0.1:1", [])
    seen = {"requests": 0, "dropped for the manifest": False}
    # A manifest another key signed, passed on as if verified: the victim ends that session.
    ms = await connect(victim_addr, creds, {"node"}, hello)
    try:
        await ms.send(wire.VersionNotice(99, _rogue_manifest()))
        with trio.move_on_after(10):
            while await ms.receive() is not None:
                pass
            seen["dropped for the manifest"] = True
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        seen["dropped for the manifest"] = True
    finally:
        await ms.aclose()
    ms = await connect(victim_addr, creds, {"node"}, hello)
    try:
        await ms.send(wire.Have(1, False, b"\xff" * 8))
        with trio.move_on_after(stop_after):
            while True:
                msg = await ms.receive()
                if msg is None:
                    break
                if isinstance(msg, wire.Request):
                    seen["requests"] += 1
                    size = _chunk_size(victim_dir, msg.version, msg.chunk)
                    await ms.send(wire.Piece(msg.version, msg.keyframe, msg.chunk, 0, size, b"\xa5" * size))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the victim hung up on us: expected
    finally:
        await ms.aclose()
    return seen


def test_lying_peer_and_foreign_manifest_are_rejected(tmp_path, checkpoints):
    watch = tmp_path / "watch"
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        lab.start_origin(region="r0", watch=watch, extra=ORIGIN_ARGS)
        victim = lab.start_node("victim", region="r1")
        publish(lab, watch, checkpoints, 0)
        lab.wait_version([victim], 0)
        rogue_creds = lab.creds("mallory", "node")
        result = {}

        async def scenario():
            async with trio.open_nursery() as n:
                async def run_rogue():
                    result.update(await _lying_peer(rogue_creds, victim.addr, victim.data_dir, "r1", 60))
                n.start_soon(run_rogue)
                await trio.sleep(2.0)  # the rogue's Have is in before version 1 exists
                publish(lab, watch, checkpoints, 1)
                await trio.to_thread.run_sync(lambda: lab.wait_version([victim], 1))
                n.cancel_scope.cancel()

        trio.run(scenario)
        st = victim.status()
        assert st["version"] == 1
        assert same_bits(load_weights(victim), served_bf16(checkpoints[1]))
        assert st["manifests_rejected"] >= 1
        assert "rejected a manifest from peer mallory" in victim.text()
        assert result["dropped for the manifest"] and st["peers_dropped"].get("invalid input", 0) >= 1
        assert result["requests"] >= 1, "the victim never asked the lying peer"
        assert st["chunks_rejected"] >= 1
        assert re.search(r"rejected chunk \d+ of v1 patch from peer mallory", victim.text())
        assert "mallory" not in {p["id"] for p in st["peers"]}
        assert re.search(r"peer mallory \(node, r1\) left: sent a chunk that does not match its manifest", victim.text())
        assert "Traceback" not in victim.text()


async def _member_announcing(creds_dir, tracker_addr: str, listen: str, region: str, stay: float) -> None:
    """A member with valid credentials that joins the tracker announcing someone else's address."""
    creds = trust.Credentials.load(creds_dir)
    ms = await connect(tracker_addr, creds, {"tracker"}, wire.Hello(creds.name, region, "node", listen, []))
    try:
        with trio.move_on_after(stay):
            while True:  # heartbeats keep the entry on the tracker's list
                await ms.send(wire.Heartbeat([]))
                with trio.move_on_after(1.0):
                    while await ms.receive() is not None:
                        pass
    finally:
        await ms.aclose()


def test_an_announced_address_that_is_not_the_member_is_refused_not_fatal(tmp_path, checkpoints):
    """A member may announce any address. Announcing the victim's own address made the
    victim dial itself and exit ('is this node'); announcing another node's address made
    nodes talk to that node under the announcer's name. Now the dialed name must match the
    certificate at the far end: the victim and its neighbour stay up and keep taking versions."""
    watch = tmp_path / "watch"
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        origin = lab.start_origin(region="r0", watch=watch, extra=ORIGIN_ARGS, wait=False)
        victim, other = lab.start_nodes([("victim", "r1"), ("other", "r1")], starting=[origin])
        publish(lab, watch, checkpoints, 0)
        lab.wait_version([victim, other], 0)
        mallory = lab.creds("mallory", "node")

        async def scenario():
            async with trio.open_nursery() as n:
                n.start_soon(_member_announcing, mallory, lab.tracker_addr, victim.addr, "r1", 60)
                await trio.to_thread.run_sync(
                    lambda: lab.wait_log(victim, r"could not reach node mallory .*dialed 'mallory', found a "
                                                 r"certificate of 'victim'", timeout=30))
                publish(lab, watch, checkpoints, 1)
                await trio.to_thread.run_sync(lambda: lab.wait_version([victim, other], 1))
                n.cancel_scope.cancel()

        trio.run(scenario)
        assert victim.alive() and other.alive()
        assert re.search(r"could not reach node mallory .*found a certificate of 'victim'", other.text())
        for p in (victim, other):
            assert same_bits(load_weights(p), served_bf16(checkpoints[1])), p.name
            assert "mallory" not in {peer["id"] for peer in p.status()["peers"]}
            assert "is this node" not in p.text() and "Traceback" not in p.text()


def _write_model_dir(watch: Path, name: str, state: dict, files: dict[str, bytes]) -> None:
    """A Hugging Face model directory (two shards, an index, side files), renamed into place."""
    from patchswarm.node.checkpoint import save_state, write_side_files

    names = sorted(state)
    layout = {n: "model-00001-of-00002.safetensors" if i % 2 else "model-00002-of-00002.safetensors"
              for i, n in enumerate(names)}
    tmp = watch / f".{name}.partial"
    save_state(state, tmp, layout)
    write_side_files(tmp, files)
    tmp.rename(watch / name)


@pytest.mark.parametrize("served_format", ["as-is", "fp8-block"])
def test_fp8_checkpoints_and_side_files_reach_every_node_bit_exactly(tmp_path, checkpoints, served_format):
    """A pre-quantized checkpoint (e4m3 weights with fp32 128x128 block scales, bf16 norms)
    published as-is, or fp32 masters quantized by the origin (fp8-block), with a model
    directory's config and tokenizer: every node holds the served bits, side files included.
    Before served formats the origin cast every floating tensor to one dtype (bf16 by
    default: the fp8 weights changed dtype and the scales were rounded)."""
    from patchswarm.protocol.served import file_tensor, file_tensor_name, serve_state

    watch = tmp_path / "watch"
    watch.mkdir()
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        origin = lab.start_origin(region="r0", watch=watch, extra=[*ORIGIN_ARGS, "--served", served_format], wait=False)
        nodes = lab.start_nodes([("a", "r1"), ("b", "r1")], starting=[origin])
        for step in range(3):
            files = {"config.json": json.dumps({"model_type": "tiny", "step": step // 2}).encode(),
                     "tokenizer.json": b'{"vocab": {"a": 0}}'}
            master = {k: v for k, v in checkpoints[step].items()}
            on_disk = serve_state(master, "fp8-block") if served_format == "as-is" else master
            _write_model_dir(watch, f"step{step:04d}", on_disk, files)
            expected = serve_state(on_disk, served_format)
            expected.update({file_tensor_name(n): file_tensor(d) for n, d in files.items()})
            assert any(t.dtype == torch.float8_e4m3fn for t in expected.values())
            lab.wait_version(nodes, step)
            for p in nodes:
                assert same_bits(load_weights(p), expected), (p.name, step)


def _every_dtype_versions(seed: int = 3) -> list[dict[str, torch.Tensor]]:
    """Two versions of a checkpoint holding every dtype the codec knows, the later ones among
    them (f64 buffers, u16/u32/u64, MX e8m0 scales, AMD's fnuz fp8 and packed fp4 weights)
    with their specials, large enough for class windows (f64, e8m0) and changed sparsely: ulp
    steps, counters across the old sign bit."""
    from patchswarm.protocol.dtypes import BY_TORCH

    g = torch.Generator().manual_seed(seed)
    n = 8192
    f64 = torch.randn(n, generator=g, dtype=torch.float64) * 0.02
    f64[:4] = torch.tensor([-0.0, float("inf"), float("-inf"), float("nan")], dtype=torch.float64)
    f64.view(torch.int64)[4] = 0x7FF800000000BEEF
    state = {
        "model.layers.0.mlp.weight": torch.randn(64, 64, generator=g),  # an fp32 master: served bf16
        "model.rotary.inv_freq": f64,
        **({"model.layers.0.mlp.weight_scale": torch.randint(110, 135, (n,), generator=g, dtype=torch.uint8)
            .view(torch.float8_e8m0fnu)} if hasattr(torch, "float8_e8m0fnu") else {}),  # torch >= 2.7
        "ids.u16": torch.randint(0, 1 << 16, (1000,), generator=g, dtype=torch.int32).to(torch.uint16),
        "ids.u32": torch.randint(0, 1 << 31, (1000,), generator=g, dtype=torch.int64).to(torch.uint32) * 2,
        "ids.u64": torch.randint(-(1 << 62), 1 << 62, (600,), generator=g, dtype=torch.int64).view(torch.uint64),
        "fp8.weight": (torch.randn(32, 32, generator=g) * 0.1).to(torch.float8_e4m3fn),
        "norm.weight": torch.ones(64, dtype=torch.bfloat16),
        "half": torch.randn(16, generator=g).to(torch.float16),
        "e5m2": torch.randn(16, generator=g).to(torch.float8_e5m2),
        "i8": torch.arange(-8, 8, dtype=torch.int8), "u8": torch.arange(16, dtype=torch.uint8),
        "i16": torch.arange(16, dtype=torch.int16), "i32": torch.arange(16, dtype=torch.int32),
        "i64": torch.arange(16, dtype=torch.int64), "mask": torch.arange(16) % 3 == 0,
        # AMD's fp8 and packed fp4 (two e2m1 a byte): kept as they are by every format
        "amd.weight": (torch.randn(32, 32, generator=g) * 0.1).to(torch.float8_e4m3fnuz),
        "amd5.weight": (torch.randn(32, 32, generator=g) * 0.1).to(torch.float8_e5m2fnuz),
        **({"fp4.weight": torch.randint(0, 256, (32, 16), generator=g, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}
           if hasattr(torch, "float4_e2m1fn_x2") else {}),  # torch >= 2.8
    }
    state["ids.u16"][:2] = torch.tensor([(1 << 15) - 1, (1 << 16) - 1], dtype=torch.int32).to(torch.uint16)
    assert {t.dtype for t in state.values()} | {torch.bfloat16} == set(BY_TORCH), "every dtype, once at least"
    nxt = {k: v.clone() for k, v in state.items()}
    nxt["model.layers.0.mlp.weight"][::9] += 1e-3
    for k in ("model.rotary.inv_freq", "model.layers.0.mlp.weight_scale", "ids.u16", "ids.u32", "ids.u64",
              "amd.weight", "amd5.weight", "fp4.weight"):
        if k not in nxt:
            continue
        t = nxt[k]
        flat = t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
        flat[5::31] += 1  # past the specials: +1 ulp, the next scale, the next id
    nxt["ids.u16"].view(torch.int16)[0] += 1  # 0x7FFF -> 0x8000: one step, no sign bit in between
    nxt["i64"][3] = -1
    return [state, nxt]


def test_a_checkpoint_of_every_dtype_reaches_the_node_and_a_follower_bit_exactly(tmp_path):
    """A model directory holding every dtype (f64, u16, u32, u64, e8m0, fnuz fp8 and fp4 among them) published
    with the default bf16 format over two versions: the node holds the served bits (the new
    dtypes as they were, the fp32 master as bf16) in its weights file and its model directory,
    and a process following its sparse changes (NodeClient.follow) holds them too. Before, the
    origin refused the checkpoint (U16/U32/U64/F8_E8M0, later F8_E4M3FNUZ/F8_E5M2FNUZ/F4 unknown;
    as-is refused f64 too)."""
    from patchswarm.node.checkpoint import load_state
    from patchswarm.protocol.served import serve_state

    versions = _every_dtype_versions()
    watch = tmp_path / "watch"
    watch.mkdir()
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        lab.start_origin(region="r0", watch=watch, extra=ORIGIN_ARGS)
        node = lab.start_node("a", region="r1", extra=["--model-dir", str(tmp_path / "model"), "--sparse-handoff"])
        follower: dict[str, torch.Tensor] = {}
        at = None
        client = node.client()
        for v, state in enumerate(versions):
            _write_model_dir(watch, f"step{v:04d}", state, {})
            expected = serve_state(state, "bf16")
            assert expected["model.rotary.inv_freq"].dtype == torch.float64
            (st,) = lab.wait_version([node], v)
            assert same_bits(load_weights(node), expected), v
            deadline = time.monotonic() + 60
            while (st := node.status()).get("model_dir_version") != v:
                assert time.monotonic() < deadline, st
                time.sleep(0.1)
            assert same_bits(load_state(st["model_dir"])[0], expected), v
            at = client.follow(follower, None if at is None else at[0], None if at is None else at[1], verify=True)
            assert at == (v, st["state_hash"]) and same_bits(follower, expected), v
        client.close()
        assert client.bootstraps == 1, "version 1 came by changes, not by reading the weights file again"
        assert "Traceback" not in node.text() and "Traceback" not in lab.procs[1].text()


def test_a_revoked_member_is_dropped_by_everyone_and_cannot_rejoin(tmp_path, checkpoints):
    """`swarm revoke` writes a signed list; the tracker (--revocations) rereads it and hands
    it on; every member ends its connections to the revoked one and refuses it from then on,
    while versions keep flowing to the others. Before revocation, a stolen certificate
    stayed good until a new CA."""
    import shutil

    watch = tmp_path / "watch"
    revocations = tmp_path / "tracker-revocations"
    with SwarmLab(tmp_path) as lab:
        tracker = lab.start_tracker(extra=["--revocations", revocations])
        origin = lab.start_origin(region="r0", watch=watch, extra=ORIGIN_ARGS, wait=False)
        good, stolen = lab.start_nodes([("good", "r1"), ("stolen", "r1")], starting=[origin])
        publish(lab, watch, checkpoints, 0)
        lab.wait_version([good, stolen], 0)
        assert "stolen" in {p["id"] for p in good.status()["peers"]}
        lab._cli("swarm", "revoke", lab.swarm, "stolen")
        t0 = time.monotonic()
        shutil.copy(lab.swarm / "revocations", revocations)
        lab.wait_log(tracker, r"revocation list 0: 1 certificates revoked; 1 member connections ended", timeout=30)
        lab.wait_log(good, r"ending the connection to stolen: its certificate .* is revoked", timeout=30)
        lab.wait_log(origin, r"ending the connection to stolen", timeout=30)
        took = time.monotonic() - t0
        assert took < 10, f"took {took:.1f} s to reach every member"
        lab.wait_log(stolen, r"tracker \S+ unreachable", timeout=30)  # refused at the tracker from now on
        publish(lab, watch, checkpoints, 1)
        lab.wait_version([good], 1)
        assert same_bits(load_weights(good), served_bf16(checkpoints[1]))
        assert stolen.status()["version"] == 0
        assert "stolen" not in {p["id"] for p in good.status()["peers"]}
        # The list survives a restart of a member that heard it.
        assert (good.data_dir / "revocations").read_bytes() == revocations.read_bytes()


def test_manifests_reach_hinted_nodes_from_peers_or_on_request_and_every_version_applies(tmp_path, checkpoints):
    """With one notice seed per region (`--notice-seeds 1`), the tracker sends each manifest whole
    to one node and a hint to the others: the rest learn it from peers, and a node with no peers
    (`--no-peers --no-listen`) asks the tracker for it. The seeds are chosen by hash of the node's
    name and the object: with these names "star" is the seed of version 2 only, so it must ask
    for versions 0, 1 and 3."""
    watch = tmp_path / "watch"
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker(extra=["--notice-seeds", "1"])
        origin = lab.start_origin(region="r0", watch=watch, extra=ORIGIN_ARGS, wait=False)
        star = lab.start_node("star", region="r0", extra=["--no-peers", "--no-listen"], wait=False)
        nodes = lab.start_nodes([(f"n{i}", "r0") for i in range(4)], starting=[origin, star])
        for v in range(4):
            publish(lab, watch, checkpoints, v)
            for p, st in zip([*nodes, star], lab.wait_version([*nodes, star], v, timeout=120)):
                assert st["version"] == v
                assert same_bits(load_weights(p), served_bf16(checkpoints[v])), f"{p.name} differs from version {v}"
        st = {p.name: p.status() for p in [*nodes, star]}
        assert st["star"]["manifests_requested"] >= 3 and st["star"]["manifests_passed_on"] == 0
        assert sum(s["manifests_passed_on"] for s in st.values()) >= 4  # each object passed on from its seed
        assert all(s["manifests_rejected"] == 0 and s["hints_waiting"] == 0 for s in st.values())
        for p in [*nodes, star]:
            assert "Traceback" not in p.text(), p.name
