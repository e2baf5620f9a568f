"""One libtorrent peer of the WAN bench (seeder or leecher), run inside a host's namespace.

Owns: the libtorrent session settings of the baseline (what we changed from
libtorrent's defaults, and why, is `SETTINGS_CHANGED`), adding the one torrent,
introducing peers with `connect_peer` (no tracker, DHT, LSD or PEX needed) and
reporting on stdout, one event per line:
    ready                     listening, torrent added (leechers: paused until `go`)
    done <monotonic> <stall>  every piece downloaded and hash-checked (leechers); stall: the
                              longest gap, in seconds, between `go` or a piece passing its hash
                              check and the next one (libtorrent's own alert timestamps), i.e.
                              the longest the leecher went without progress while it lacked pieces
Reads commands on stdin: `go` (start), `quit` (stop seeding, exit).
Must not import anything but the standard library and libtorrent (it starts
once per node, so it must start fast), and must not run past --limit-s.

Usage: python bench/wan_libtorrent_peer.py --role seed|leech --ip IP --torrent T
       --save DIR [--peers IP:PORT,...] [--unchoke-slots N] [--limit-s S]
"""

from __future__ import annotations

import argparse
import select
import sys
import time

import libtorrent as lt

PORT = 6881

# Every setting we change from libtorrent 2.x defaults, with the reason.
SETTINGS_CHANGED = {
    "enable_dht": (False, "peers are introduced with connect_peer; no DHT traffic on the links"),
    "enable_lsd": (False, "no local service discovery multicast"),
    "enable_upnp": (False, "no port mapping"),
    "enable_natpmp": (False, "no port mapping"),
    "enable_outgoing_utp": (False, "TCP only: uTP's LEDBAT backs off on the tbf queueing delay"),
    "enable_incoming_utp": (False, "TCP only (as above)"),
    "rate_limit_ip_overhead": (False, "no libtorrent limit is set, so nothing to count overhead against"),
    "alert_mask": (None, "status + error + piece progress alerts: torrent_finished at once, "
                         "piece_finished for the stall"),
}
# Unchanged on purpose: upload_rate_limit = download_rate_limit = 0 (unlimited): tc is the only limit.
# Changed outside the settings pack: the peer-class filter (every address in the global class,
# so local peers get no exemption: see `main`).


def session_settings(ip: str, unchoke_slots: int) -> dict:
    s = {name: value for name, (value, _) in SETTINGS_CHANGED.items() if value is not None}
    c = lt.alert.category_t
    s["alert_mask"] = int(c.status_notification | c.error_notification | c.piece_progress_notification)
    s["listen_interfaces"] = f"{ip}:{PORT}"
    s["upload_rate_limit"] = 0
    s["download_rate_limit"] = 0
    if unchoke_slots != 8:       # libtorrent's default is 8; -1 = unchoke everyone
        s["unchoke_slots_limit"] = unchoke_slots
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["seed", "leech"], required=True)
    ap.add_argument("--ip", required=True)
    ap.add_argument("--torrent", required=True)
    ap.add_argument("--save", required=True)
    ap.add_argument("--peers", default="")
    ap.add_argument("--unchoke-slots", type=int, default=8)
    ap.add_argument("--limit-s", type=float, default=600.0)
    a = ap.parse_args(argv)
    deadline = time.monotonic() + a.limit_s

    ses = lt.session(session_settings(a.ip, a.unchoke_slots))
    # By default libtorrent puts private/local addresses in the "local" peer class, which
    # is exempt from rate limits and from unchoke slots. The issue asks for that exemption
    # off: every address goes to the global class.
    every = lt.ip_filter()
    every.add_rule("0.0.0.0", "255.255.255.255", 1 << lt.session.global_peer_class_id)
    ses.set_peer_class_filter(every)

    atp = lt.add_torrent_params()
    atp.ti = lt.torrent_info(a.torrent)
    atp.save_path = a.save
    if a.role == "seed":
        atp.flags = lt.torrent_flags.seed_mode     # the file is there; skip the full re-hash
    else:
        atp.flags = lt.torrent_flags.paused        # not auto-managed: no queueing
    handle = ses.add_torrent(atp)
    _wait_listening(ses, deadline)
    print("ready", flush=True)

    if _read_command(deadline) != "go":
        return 1
    gaps = PieceGaps(time.time())   # the alerts' timestamps are wall-clock (system_clock)
    handle.resume()
    if a.role == "leech":
        for p in filter(None, a.peers.split(",")):
            host, port = p.rsplit(":", 1)
            handle.connect_peer((host, int(port)))
    done = a.role == "seed"
    while time.monotonic() < deadline:
        ses.wait_for_alert(20)
        finished = False
        for al in ses.pop_alerts():
            finished |= isinstance(al, lt.torrent_finished_alert)
            if isinstance(al, lt.piece_finished_alert):
                gaps.piece_at(al.timestamp().timestamp())
        if not done and (finished or handle.status().is_seeding):
            print(f"done {time.monotonic():.6f} {gaps.longest:.3f}", flush=True)
            done = True
        if _stdin_ready(0) and sys.stdin.readline().strip() in ("quit", ""):
            return 0
    return 0 if done else 2


class PieceGaps:
    """The longest time between the start and a piece passing its hash check, or between two such pieces."""

    def __init__(self, start: float):
        self.last = start
        self.longest = 0.0

    def piece_at(self, t: float) -> None:
        self.longest = max(self.longest, t - self.last)
        self.last = max(self.last, t)


def _wait_listening(ses, deadline: float) -> None:
    while time.monotonic() < deadline:
        ses.wait_for_alert(100)
        for al in ses.pop_alerts():
            if isinstance(al, lt.listen_failed_alert):
                raise SystemExit(f"listen failed: {al.message()}")
        if ses.is_listening() and ses.listen_port():
            return
    raise SystemExit("not listening before the time limit")


def _stdin_ready(timeout: float) -> bool:
    return bool(select.select([sys.stdin], [], [], timeout)[0])


def _read_command(deadline: float) -> str:
    if not _stdin_ready(max(0.0, deadline - time.monotonic())):
        return ""
    return sys.stdin.readline().strip()


if __name__ == "__main__":
    sys.exit(main())
