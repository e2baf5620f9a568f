"""The libtorrent baseline of the WAN bench: BitTorrent moving the same patch bytes.

Owns: making a .torrent of the patch file, starting one seeder (origin's
namespace) and one leecher per node (`bench/wan_libtorrent_peer.py` in the
node's namespace), starting them all at once, collecting when each leecher has
every piece verified, and the byte counters of that window.

The clock starts when `go` is written to every peer: leechers hold the
.torrent (the metadata) already, are listening, and then connect to the
seeder and to every other node (`connect_peer`, a full mesh, as a tracker
returning all peers would give). Must not change the topology's limits.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.netemu import Topology
from bench.wan_runner import LineEvents, Payload, RunFailed, RunResult, SystemUnavailable, keep_logs, log_tails

PEER_SCRIPT = Path(__file__).with_name("wan_libtorrent_peer.py")
DEFAULT_PIECE_BYTES = 64 * 1024   # best of 16 KiB..4 MiB on the default topology (16-64 KiB tie)


class LibtorrentRunner:
    """BitTorrent (libtorrent 2.x, v1 torrent, TCP only) over the emulated WAN."""

    name = "libtorrent"

    def __init__(self, piece_bytes: int = DEFAULT_PIECE_BYTES, unchoke_slots: int = 8,
                 log_dir: Path | None = None):
        self.piece_bytes = piece_bytes
        self.unchoke_slots = unchoke_slots
        self.log_dir = log_dir      # copy each peer's stderr under log_dir/libtorrent-<R>x<N>/

    def available(self) -> str | None:
        try:
            import libtorrent  # noqa: F401
        except ImportError as e:
            return f"libtorrent is not installed ({e}); pip install libtorrent"
        return None

    def run(self, topo: Topology, payload: Payload, limit_s: float) -> RunResult:
        reason = self.available()
        if reason:
            raise SystemUnavailable(reason)
        work = Path(tempfile.mkdtemp(prefix="psw-lt-"))
        try:
            return self._run(topo, payload, limit_s, work)
        finally:
            keep_logs(self.log_dir, work / "logs", f"{self.name}-{topo.spec.regions}x{topo.spec.nodes_per_region}")
            shutil.rmtree(work, ignore_errors=True)

    def _run(self, topo: Topology, payload: Payload, limit_s: float, work: Path) -> RunResult:
        seed_dir = work / "origin"
        seed_dir.mkdir()
        shutil.copyfile(payload.patch, seed_dir / "patch.bin")
        torrent = work / "patch.torrent"
        torrent.write_bytes(make_torrent(seed_dir / "patch.bin", self.piece_bytes))
        deadline = time.monotonic() + limit_s
        from bench.wan_libtorrent_peer import PORT

        everyone = [topo.origin, *topo.nodes]
        procs: dict[str, subprocess.Popen] = {}
        logs = work / "logs"
        logs.mkdir()
        for h in everyone:
            save = seed_dir if h is topo.origin else work / h.name
            save.mkdir(exist_ok=True)
            peers = ",".join(f"{o.ip}:{PORT}" for o in everyone if o is not h)
            argv = [sys.executable, str(PEER_SCRIPT), "--role", "seed" if h is topo.origin else "leech",
                    "--ip", h.ip, "--torrent", str(torrent), "--save", str(save), "--peers", peers,
                    "--unchoke-slots", str(self.unchoke_slots), "--limit-s", str(limit_s + 30)]
            with open(logs / f"{h.name}.log", "wb") as err:
                procs[h.name] = topo.spawn(h, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        events = LineEvents(procs)
        try:
            events.wait_all(set(procs), "ready", deadline)
            before = topo.counters()
            t0 = time.monotonic()
            for p in procs.values():
                p.stdin.write(b"go\n")
                p.stdin.flush()
            done = events.wait_all({h.name for h in topo.nodes}, "done", deadline)
            moved = topo.counters() - before
        except RunFailed as e:
            raise RunFailed(f"libtorrent: {e}{log_tails(logs)}") from None
        finally:
            for p in procs.values():
                if p.poll() is None:
                    try:
                        p.stdin.write(b"quit\n")
                        p.stdin.flush()
                    except BrokenPipeError:
                        pass
        per_node = {name: float(t) - t0 for name, t in done.items()}
        notes = [f"piece {self.piece_bytes // 1024} KiB, v1 torrent, TCP only, unchoke slots "
                 f"{'all' if self.unchoke_slots < 0 else self.unchoke_slots}, peers by connect_peer (full mesh)"]
        return RunResult(self.name, topo.spec, payload.patch_bytes, max(per_node.values()), per_node, moved, notes)


def make_torrent(file: Path, piece_bytes: int) -> bytes:
    """A v1 .torrent of one file (v1 only: no v2 merkle-hash requests on the wire)."""
    import libtorrent as lt

    ct = lt.create_torrent(lt.list_files(str(file)), piece_bytes, lt.create_torrent.v1_only)
    lt.set_piece_hashes(ct, str(file.parent))
    return lt.bencode(ct.generate())

