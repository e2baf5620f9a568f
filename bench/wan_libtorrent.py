"""The libtorrent baseline of the WAN bench: BitTorrent moving the same patch bytes.

Owns: making a .torrent of the patch file, starting one seeder (origin's
namespace) and one leecher per node (`bench/wan_libtorrent_peer.py` in the
node's namespace), starting them all at once, collecting when each leecher has
every piece verified, and the byte counters of that window.

The clock starts when `go` is written to every peer: leechers hold the
.torrent (the metadata) already, are listening, and then connect to the
seeder and to every other node (`connect_peer`, a full mesh, as a tracker
returning all peers would give). Must not change the topology's limits.

With `faults`, the same schedule as `patchswarm-faults` on the leechers: at
`kill_at` s after `go`, SIGKILL the leechers named by `victims(topo)` (the
bench passes patchswarm's first gateway of each remote region, so both
systems lose the same hosts); at `restart_at`, start the first one again on
its save dir: libtorrent hash-checks the pieces the file already holds and
fetches the rest. Times and stalls are then over the leechers never killed.

"max stall" (`RunResult.stall_s`): per leecher, the longest gap between `go`
or a piece passing its hash check and the next piece doing so (libtorrent's
own alert timestamps, `piece_finished_alert`), i.e. the longest it went
without progress while it lacked pieces. patchswarm's is the same with its
unit, a chunk (bigger: ~0.9 MB against a 64 KiB piece).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from bench.netemu import Topology
from bench.wan_runner import Faults, LineEvents, Payload, RunFailed, RunResult, SystemUnavailable, keep_logs, log_tails

PEER_SCRIPT = Path(__file__).with_name("wan_libtorrent_peer.py")
DEFAULT_PIECE_BYTES = 64 * 1024   # best of 16 KiB..4 MiB on the default topology (16-64 KiB tie)


class LibtorrentRunner:
    """BitTorrent (libtorrent 2.x, v1 torrent, TCP only) over the emulated WAN."""

    def __init__(self, piece_bytes: int = DEFAULT_PIECE_BYTES, unchoke_slots: int = 8,
                 log_dir: Path | None = None, faults: Faults | None = None,
                 victims: Callable[[Topology], list[str]] | None = None):
        self.piece_bytes = piece_bytes
        self.unchoke_slots = unchoke_slots
        self.log_dir = log_dir      # copy each peer's stderr under log_dir/<system>-<R>x<N>-<run>/
        self.last_logs: Path | None = None  # where the last run's logs were kept
        if faults is not None and victims is None:
            raise ValueError("faults: expected the victims (a function of the topology), found None")
        self.faults, self.victims = faults, victims
        self.name = "libtorrent" + ("" if faults is None else f" {faults.label()}")

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
            self.last_logs = keep_logs(self.log_dir, work / "logs",
                                       f"{self.name}-{topo.spec.regions}x{topo.spec.nodes_per_region}")
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
        hosts = {h.name: h for h in everyone}
        procs: dict[str, subprocess.Popen] = {}
        argvs: dict[str, list[str]] = {}
        logs = work / "logs"
        logs.mkdir()
        for h in everyone:
            save = seed_dir if h is topo.origin else work / h.name
            save.mkdir(exist_ok=True)
            peers = ",".join(f"{o.ip}:{PORT}" for o in everyone if o is not h)
            argvs[h.name] = [sys.executable, str(PEER_SCRIPT), "--role", "seed" if h is topo.origin else "leech",
                             "--ip", h.ip, "--torrent", str(torrent), "--save", str(save), "--peers", peers,
                             "--unchoke-slots", str(self.unchoke_slots), "--limit-s", str(limit_s + 30)]
            procs[h.name] = self._spawn(topo, h, argvs[h.name], logs / f"{h.name}.log")
        killed = [] if self.faults is None else self.victims(topo)
        schedule = [] if self.faults is None else self.faults.events(killed)
        events = LineEvents(procs)
        everything = list(procs.values())      # killed ones too, for the clean-up
        try:
            events.wait_all(set(procs), "ready", deadline)
            before = topo.counters()
            t0 = time.monotonic()
            for p in procs.values():
                _command(p, "go")
            pending, done, restarted = {h.name for h in topo.nodes}, {}, set()
            while pending:
                ev = events.next(min(deadline, t0 + schedule[0][0]) if schedule else deadline)
                if ev is None:
                    if not schedule or time.monotonic() >= deadline:
                        missing = sorted(pending)
                        raise RunFailed(f"no 'done' within the time limit from {len(missing)} leechers: {missing[:6]}")
                    _, what, name = schedule.pop(0)
                    if what == "kill":
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(procs[name].pid, signal.SIGKILL)   # `ip netns exec` execs: the same pid
                        events.drop(name)
                        pending.discard(name)
                        done.pop(name, None)
                    else:
                        procs[name] = self._spawn(topo, hosts[name], argvs[name], logs / f"{name}.restarted.log")
                        everything.append(procs[name])
                        events.add(name, procs[name])
                        pending.add(name)
                        restarted.add(name)
                    continue
                name, line = ev
                head, _, rest = line.partition(" ")
                if head == "ready" and name in restarted:
                    _command(procs[name], "go")
                elif head == "done" and name in pending:
                    done[name] = rest
                    pending.discard(name)
            moved = topo.counters() - before
        except RunFailed as e:
            raise RunFailed(f"{self.name}: {e}{log_tails(logs)}") from None
        finally:
            for p in everything:
                if p.poll() is None:
                    with contextlib.suppress(BrokenPipeError):
                        _command(p, "quit")
        kept = {n: rest.split() for n, rest in done.items() if n not in killed}
        per_node = {n: float(f[0]) - t0 for n, f in kept.items()}
        stalls = {n: float(f[1]) for n, f in kept.items() if len(f) > 1}
        notes = [f"piece {self.piece_bytes // 1024} KiB, v1 torrent, TCP only, unchoke slots "
                 f"{'all' if self.unchoke_slots < 0 else self.unchoke_slots}, peers by connect_peer (full mesh)",
                 "stall = the longest a leecher went without a piece passing its hash check while it lacked "
                 "pieces (from `go`; libtorrent's piece_finished_alert timestamps)"]
        if self.faults is not None:
            back = {n: f"{float(done[n].split()[0]) - t0:.2f} s" for n in sorted(restarted) if n in done}
            notes.append(f"{self.faults.label()}: killed {sorted(killed)} (patchswarm's first gateways of v1); "
                         f"restarted and complete: {back or 'none'}; times, stalls and bounds over the "
                         f"{len(per_node)} leechers never killed")
        return RunResult(self.name, topo.spec, payload.patch_bytes, max(per_node.values()), per_node, moved, notes,
                         stall_s=stalls)

    @staticmethod
    def _spawn(topo: Topology, host, argv: list[str], log: Path) -> subprocess.Popen:
        with open(log, "wb") as err:
            return topo.spawn(host, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)


def _command(p: subprocess.Popen, word: str) -> None:
    p.stdin.write(word.encode() + b"\n")
    p.stdin.flush()


def make_torrent(file: Path, piece_bytes: int) -> bytes:
    """A v1 .torrent of one file (v1 only: no v2 merkle-hash requests on the wire)."""
    import libtorrent as lt

    ct = lt.create_torrent(lt.list_files(str(file)), piece_bytes, lt.create_torrent.v1_only)
    lt.set_piece_hashes(ct, str(file.parent))
    return lt.bencode(ct.generate())

