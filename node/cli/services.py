"""`patchswarm origin | node | status | trajectories`: the member services and what they show.

Owns their arguments and how `status` shows a node to people (a rich table)
and to programs (`--json`); running a service (configuration layers, logging,
metrics, readiness, clean stop on SIGINT/SIGTERM) is node/net/service.py's,
shared with the tracker.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from patchswarm.node.cli import command
from patchswarm.node.net.logs import event
from patchswarm.node.net.service import (DRAIN_S, add_advertise_argument, add_member_arguments,
                                        add_require_region_argument, add_uplink_argument, address,
                                        loopback_warning, format_wan_rates, parse_region_rates, run_service)
from patchswarm.protocol.errors import UsageError


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, found {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, found {text!r}")
    return value


def seconds(text: str) -> float:
    """A number of seconds >= 0 (a flag's value)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, found {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, found {text!r}")
    return value


def positive_int(text: str) -> int:
    value = non_negative_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, found {text!r}")
    return value


def region_label(text: str) -> str:
    """A member's --region: what a Hello may carry and its peers take (node/net/trust.py
    `region_fault`), checked by `config check` too, not first at the service's start."""
    from patchswarm.node.net.trust import region_fault

    fault = region_fault(text)
    if fault is not None:
        raise argparse.ArgumentTypeError(f"expected {fault}, found {text!r}")
    return text


def parse_rate(text: str | None) -> float | None:
    """Bytes per second: a number with an optional k/M/G suffix (powers of 10), or 'none'."""
    if text is None or text.lower() in ("none", "0", ""):
        return None
    scale = {"k": 1e3, "m": 1e6, "g": 1e9}
    t = text.strip().lower().removesuffix("b/s").removesuffix("/s")
    mult = scale.get(t[-1:], 1.0)
    try:
        value = float(t[:-1] if t[-1:] in scale else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes per second like 12500000 or 12.5M, found {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive rate, found {text!r}")
    return value


def _origin_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tracker", metavar="HOST:PORT", required=True, type=address, help="the tracker's address")
    p.add_argument("--key", metavar="TRAINER_KEY", required=True, type=Path, help="the trainer's signing key (trainer.key)")
    p.add_argument("--data-dir", metavar="D", required=True, type=Path, help="where published versions and trajectories live")
    p.add_argument("--region", default="default", type=region_label, help="region label of the trainer's datacenter (default: default)")
    p.add_argument("--watch", metavar="CKPT_DIR", type=Path,
                   help="publish each new checkpoint in name order: a .safetensors file or a model directory "
                        "(shards, index, config and tokenizer files)")
    p.add_argument("--served", default="bf16", choices=["as-is", "bf16", "fp16", "fp32", "fp8-block"],
                   help="served format: as-is keeps every tensor's dtype and bits (pre-quantized fp8 checkpoints); "
                        "bf16/fp16/fp32 cast fp32, fp16 and bf16 tensors, never fp8, fp4, f64 or e8m0 ones or scales; "
                        "fp8-block quantizes 2-D weights to e4m3 with fp32 128x128 block scales (default bf16)")
    p.add_argument("--upload-limit", type=parse_rate, metavar="BYTES_PER_S",
                   help="cap on chunk upload rate, e.g. 200M (default: none, unlimited)")
    p.add_argument("--chunk-bytes", type=int, help="target size of a swarm chunk (default 1 MiB)")
    p.add_argument("--segment-elements", type=int,
                   help="elements per patch segment, the unit chunks are made of (default 2**20)")
    p.add_argument("--manifest-form", type=int, choices=(1, 2),
                   help="manifest form: 1 (every member reads it; the whole tensor table each version) or 2 "
                        "(patch manifests list only what changed; needs nodes and tracker from 2026-12-05 on); "
                        "default: 1 up to 4,096 tensors, 2 above")
    p.add_argument("--record-id-window", type=positive_int, metavar="N",
                   help="record keys the trajectory store remembers (the newest stored): a record whose client "
                        "record id is among them is not stored again, through whichever node it came; ~40 bytes "
                        "of memory each (default 2**20)")
    _compact_argument(p)
    add_uplink_argument(p, "The origin's is only shown: nodes plan their shares with the nodes' uplinks")
    add_require_region_argument(p)
    add_member_arguments(p, "127.0.0.1:0")
    add_advertise_argument(p)


def _warn_if_unreachable(args: argparse.Namespace) -> None:
    why = loopback_warning(args.advertise or args.listen, args.tracker)
    if why is not None:
        logging.getLogger("patchswarm").warning(why, extra=event("advertise_loopback", advertised=args.advertise
                                                                 or args.listen, tracker=args.tracker))


@command("origin", "run the origin: publish versions, seed chunks, take trajectories in", _origin_args)
def cmd_origin(args: argparse.Namespace) -> int:
    from patchswarm.node.trainer.origin import Origin, OriginConfig

    sizes = {k: v for k, v in (("chunk_bytes", args.chunk_bytes), ("segment_elements", args.segment_elements))
             if v is not None}
    if any(v < 1024 for v in sizes.values()):
        raise UsageError("origin: --chunk-bytes and --segment-elements must be at least 1024")
    from patchswarm.node.net.metrics import OriginMetrics

    o = Origin(OriginConfig(args.tracker, args.creds, args.key, args.data_dir, args.listen, args.region,
                            args.upload_limit, **sizes, advertise=args.advertise, compact_every=args.compact_every,
                            manifest_form=args.manifest_form,
                            record_id_window=args.record_id_window or OriginConfig.record_id_window,
                            uplink_mbit=args.uplink_mbit, require_region=args.require_region))

    async def start(task_status):
        import trio

        _warn_if_unreachable(args)
        async with trio.open_nursery() as n:
            await n.start(o.run)
            if args.watch is not None:
                n.start_soon(o.watch, args.watch, args.served)
            task_status.started(o.stats)

    return run_service(f"origin {o.id}", start, args, OriginMetrics())


def _node_args(p: argparse.ArgumentParser) -> None:
    from patchswarm.node.lowprio import APPLY_NICE
    from patchswarm.node.net.admission import CONNECTION_BURST
    from patchswarm.protocol.picker import WAN_GATEWAYS

    p.add_argument("--tracker", metavar="HOST:PORT", required=True, type=address, help="the tracker's address")
    p.add_argument("--data-dir", metavar="D", required=True, type=Path,
                   help="weights, chunks, trajectory spool and the local socket D/node.sock")
    p.add_argument("--region", required=True, type=region_label, help="region label (peers in the same region are preferred)")
    p.add_argument("--upload-limit", type=parse_rate, metavar="BYTES_PER_S",
                   help="cap on chunk upload rate, e.g. 200M (default: none, unlimited)")
    p.add_argument("--download-limit", type=parse_rate, metavar="BYTES_PER_S",
                   help="cap on download rate, e.g. 1G (default: none, unlimited)")
    p.add_argument("--no-peers", action="store_true", help="fetch from the origin only (for comparisons)")
    p.add_argument("--spool-bytes", type=int, default=1 << 30,
                   help="trajectory spool size limit; submit waits when it is full (default 1 GiB)")
    p.add_argument("--drain-s", type=seconds, default=DRAIN_S, metavar="S",
                   help=f"on SIGTERM or SIGINT, keep uploading the trajectory spool for up to S seconds before "
                        f"exiting, refusing new submits (code 'stopping'); a second signal stops at once "
                        f"(default {DRAIN_S:g}; 0: stop at once)")
    p.add_argument("--apply-nice", type=non_negative_int, default=APPLY_NICE, metavar="N",
                   help=f"apply versions N nice steps below the daemon, so serving peers comes first "
                        f"(default {APPLY_NICE}; 0: same priority)")
    p.add_argument("--apply-threads", type=non_negative_int, default=0, metavar="N",
                   help="threads that decode and hash a version (default 0: one per core, as the work is worth)")
    p.add_argument("--wan-gateways", type=non_negative_int, default=WAN_GATEWAYS, metavar="K",
                   help=f"members per region that bring each version across the WAN (default {WAN_GATEWAYS}; "
                        f"0: every member)")
    p.add_argument("--wan-rates", type=parse_region_rates, metavar="REGION=MBIT,...",
                   help="each region's WAN link rate (Mbit/s, each way); the same on every member: each chunk "
                        "crosses the regions from the fastest link to the slowest (default: not known, "
                        "a per-chunk order)")
    p.add_argument("--member-connections", type=non_negative_int, default=CONNECTION_BURST, metavar="N",
                   help=f"connections one member (by certificate name) may open to this node: N in a row and N a "
                        f"minute; more are refused before the Hello exchange (default {CONNECTION_BURST}; 0: no limit)")
    add_uplink_argument(p, "A node whose uplink is under its region's median relays a smaller share of each "
                           "version, and one under half of it brings none into its region while enough others can; "
                           "a node that declares none counts as the median")
    add_require_region_argument(p)
    _compact_argument(p)
    p.add_argument("--no-keep-keyframe", action="store_true",
                   help="drop the latest keyframe with the other old versions even where this node holds it; by "
                        "default a node that joined through it keeps it, and the patches after it, until the next "
                        "keyframe (while the disk has the base file's size free), so that later joiners take them "
                        "from peers instead of the origin")
    h = p.add_argument_group("hand-off to the inference engine (none by default)")
    h.add_argument("--model-dir", metavar="D", type=Path,
                   help="keep the current version as a Hugging Face model directory D/current (versioned, switched "
                        "atomically; unchanged shards are not rewritten); default D_DATA/model when an engine "
                        "or --on-version is given")
    h.add_argument("--engine", choices=["sglang", "vllm"],
                   help="tell this engine of each version: sglang (POST /update_weights_from_disk) or vllm "
                        "(POST /collective_rpc reload_weights; serve it from the model directory's current link, which "
                        "then moves only between its reloads)")
    h.add_argument("--engine-url", metavar="URL", help="the engine's HTTP address, e.g. http://127.0.0.1:30000")
    h.add_argument("--sparse-handoff", action="store_true",
                   help="record each version's changes (positions and new bits, ~6 B per changed bf16 element) "
                        "so a process holding the weights follows by sparse changes (NodeClient.follow)")
    h.add_argument("--on-version", metavar="CMD",
                   help="run CMD (a shell command) for each version, with PATCHSWARM_VERSION, PATCHSWARM_MODEL_DIR "
                        "and PATCHSWARM_STATE_HASH in its environment; exit 0 is success")
    add_member_arguments(p, "127.0.0.1:0")
    add_advertise_argument(p)
    _transport_args(p)


def _transport_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transport", choices=("tcp", "webrtc", "auto"), default="tcp",
                   help="how to reach other nodes: TCP+TLS (default); WebRTC data channels signalled through the "
                        "tracker (for hosts behind NAT); auto: TCP where the peer is reachable, WebRTC otherwise. "
                        "The origin is always reached over TCP")
    p.add_argument("--no-listen", action="store_true",
                   help="accept no inbound connections (behind NAT): peers reach this node over WebRTC only")
    p.add_argument("--stun", metavar="HOST:PORT", type=address,
                   help="STUN server for WebRTC (default: none; no public server is contacted unless given)")
    p.add_argument("--turn", metavar="URL", help="TURN server for WebRTC, turn:HOST:PORT[?transport=udp|tcp]")
    p.add_argument("--turn-user", metavar="NAME", help="TURN user name")
    p.add_argument("--turn-password", metavar="SECRET", help="TURN password")
    p.add_argument("--ice-host", metavar="IP", nargs="+",
                   help="offer WebRTC host candidates on these local addresses only "
                        "(default: every interface but 127.0.0.1)")


def _ice_config(args: argparse.Namespace):
    from patchswarm.node.net.webrtc import IceConfig

    if args.turn and not (args.turn_user and args.turn_password):
        raise UsageError("--turn: expected --turn-user and --turn-password with it")
    return IceConfig(args.stun, args.turn, args.turn_user, args.turn_password,
                     tuple(args.ice_host) if args.ice_host else None)


def _compact_argument(p: argparse.ArgumentParser) -> None:
    from patchswarm.node.compaction import COMPACT_EVERY

    p.add_argument("--compact-every", type=positive_int, default=COMPACT_EVERY, metavar="N",
                   help=f"versions between full writes of the state (the base; node/persistence.py); in between "
                        f"each version costs the disk its patch (default {COMPACT_EVERY})")


@command("node", "run a node daemon: fetch, verify and apply versions; serve peers", _node_args)
def cmd_node(args: argparse.Namespace) -> int:
    from patchswarm.node.daemon import Node, NodeConfig
    from patchswarm.node.net.metrics import NodeMetrics

    n = Node(NodeConfig(args.tracker, args.creds, args.data_dir, args.listen, args.region,
                        args.upload_limit, args.download_limit, args.no_peers, spool_bytes=args.spool_bytes,
                        apply_nice=args.apply_nice, apply_threads=args.apply_threads or None,
                        wan_gateways=args.wan_gateways or None, wan_rates=args.wan_rates, advertise=args.advertise,
                        compact_every=args.compact_every, model_dir=args.model_dir, engine=args.engine,
                        engine_url=args.engine_url, on_version=args.on_version,
                        sparse_handoff=args.sparse_handoff, transport=args.transport, no_listen=args.no_listen,
                        keep_keyframe=not args.no_keep_keyframe, ice=_ice_config(args),
                        member_connections=args.member_connections,
                        uplink_mbit=args.uplink_mbit, require_region=args.require_region, drain_s=args.drain_s))

    async def start(task_status):
        import trio

        if not args.no_listen:
            _warn_if_unreachable(args)
        async with trio.open_nursery() as nursery:
            await nursery.start(n.run)
            task_status.started(n.status)

    return run_service(f"node {n.id}", start, args, NodeMetrics(), drain=n.drain)


def _status_args(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--data-dir", metavar="D", type=Path, help="the node's data dir (uses D/node.sock)")
    where.add_argument("--socket", metavar="PATH", type=Path, help="the node's local socket")
    p.add_argument("--json", action="store_true", help="print one JSON object")


@command("status", "show a running node's state", _status_args)
def cmd_status(args: argparse.Namespace) -> int:
    from patchswarm.node.client import NodeClient, socket_path

    path = args.socket if args.socket is not None else socket_path(args.data_dir)
    with NodeClient(path) as client:
        st = client.status()
    if args.json:
        print(json.dumps(st))
        return 0
    print_status(st)
    return 0


def _trajectories_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", metavar="D", required=True, type=Path, help="the origin's data dir")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--dump", action="store_true",
                   help="print every record as one JSON line (node_id, seq, policy_version, payload_b64, ...)")
    p.add_argument("--max-staleness", type=int, metavar="N",
                   help="count as stale the records more than N versions behind the origin's current version")


@command("trajectories", "summarise (or dump) the trajectories an origin has received", _trajectories_args)
def cmd_trajectories(args: argparse.Namespace) -> int:
    from patchswarm.node.trainer.trajstore import TrajectoryReader
    from patchswarm.node.store import latest_version

    directory = args.data_dir / "trajectories"
    if not directory.is_dir():
        raise UsageError(f"{args.data_dir}: no trajectories here (is it an origin's data dir?)")
    reader = TrajectoryReader(directory)
    if args.dump:
        reader.dump_jsonl(sys.stdout)
        return 0
    current = latest_version(args.data_dir / "objects")  # the origin's last published version
    summary = {"current_version": current, "max_staleness": args.max_staleness,
               **reader.summary(current, args.max_staleness)}
    if args.json:
        print(json.dumps(summary))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"trajectories at {args.data_dir}", show_header=False)
    t.add_column("field", style="bold")
    t.add_column("value", overflow="fold")
    t.add_row("records", f"{summary['records']:,} ({_mb(summary['payload_bytes'])} of payload)")
    t.add_row("duplicates dropped", f"{summary['duplicates_dropped']:,}")
    stale = f"{summary['stale']:,}" if args.max_staleness is not None else "- (give --max-staleness)"
    t.add_row("stale", stale)
    t.add_row("by node", ", ".join(f"{k}: {v:,}" for k, v in summary["by_node"].items()) or "-")
    t.add_row("by version", ", ".join(f"v{k}: {v:,}" for k, v in summary["by_version"].items()) or "-")
    if summary.get("untallied_versions"):
        t.add_row("of further versions", f"{summary['untallied_versions']:,} (not counted one by one)")
    if summary["problems"]:
        t.add_row("problems", "; ".join(summary["problems"]))
    Console().print(t)
    return 0


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.2f} MB"


def print_status(st: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"node {st['node_id']} ({st['region']})", show_header=False)
    t.add_column("field", style="bold")
    t.add_column("value", overflow="fold")
    latest = st.get("latest_version")
    behind = "" if latest is None or st["version"] is None or latest <= st["version"] else f" (latest {latest})"
    t.add_row("version", f"{'-' if st['version'] is None else st['version']}{behind}")
    t.add_row("state hash", str(st.get("state_hash") or "-"))
    base = st.get("base_version")
    t.add_row("durable", f"base {st['base_path']} at version {'-' if base is None else base}, "
                         f"the stored patches after it; {st.get('compactions', 0)} compactions")
    if st.get("kept_keyframe") is not None:
        t.add_row("for joiners", f"v{st['kept_keyframe']}'s keyframe and the patches after it, kept")
    if st.get("model_dir"):
        err = st.get("model_dir_error")
        ahead = st.get("model_dir_written")
        ahead = (f", version {ahead} written, current before the engine's next reload"
                 if ahead is not None and ahead != st.get("model_dir_version") else "")
        t.add_row("model dir", f"{st['model_dir']} (version {st.get('model_dir_version')}{ahead})"
                               + (f"; last write failed: {err}" if err else ""))
    engine = st.get("engine")
    if engine:
        lat = engine.get("publish_to_engine_s")
        t.add_row("engine", f"{engine['name']} at version {engine.get('version')}"
                            + ("" if lat is None else f", publish->engine {lat:.2f} s")
                            + (f"; last error: {engine['last_error']}" if engine.get("last_error") else ""))
    t.add_row("tracker", "connected" if st.get("tracker_connected") else "not connected")
    declared, measured, part = st.get("uplink_mbit"), st.get("uplink_measured_mbit"), st.get("part_bytes")
    said = st.get("uplink_said_mbit")
    if declared or measured:
        t.add_row("uplink", ", ".join(
            ([f"{declared:g} Mbit/s declared" + (f" (sends parts of {part >> 10} KiB)" if part else "")]
             if declared else [])
            + ([f"{measured:g} Mbit/s measured while sends backed up"] if measured else [])
            + ([f"planned on {said:g} Mbit/s"] if said and said != declared else [])))
    if st.get("slow_neighbours"):
        t.add_row("slow neighbours",
                  ", ".join(st["slow_neighbours"]) + " (by the uplinks they say: asked last, no share)")
    if st.get("wan_rates"):
        t.add_row("WAN rates", format_wan_rates(st["wan_rates"]) + " Mbit/s (each chunk's regions, fastest first)")
    b = st["bytes_in"]
    t.add_row("bytes in", f"origin {_mb(b['origin'])}, same region {_mb(b['same_region'])}, "
                          f"other regions {_mb(b['other_region'])}")
    out = _mb(st["bytes_out"])
    if st.get("bytes_out_arriving"):
        out += f" ({_mb(st['bytes_out_arriving'])} relayed while arriving)"
    t.add_row("bytes out", out)
    stale = f" ({st['manifests_stale']:,} old ones refused unread)" if st.get("manifests_stale") else ""
    t.add_row("rejected", f"{st['chunks_rejected']} chunks, {st.get('manifests_rejected', 0)} manifests{stale}")
    if st.get("peers_dropped") or st.get("sessions_replaced"):  # a hostile or unlucky peer shows here
        kinds = ", ".join(f"{k}: {v:,}" for k, v in sorted(st.get("peers_dropped", {}).items()))
        t.add_row("peers dropped", (kinds or "none")
                  + (f"; {st['sessions_replaced']:,} sessions replaced by a reconnect" if st.get("sessions_replaced")
                     else ""))
    if st.get("fetching"):
        t.add_row("fetching", ", ".join(f"{k}: {v} chunks missing" for k, v in st["fetching"].items()))
    if st.get("unusable"):
        t.add_row("unusable", ", ".join(st["unusable"]) + " (failed to apply; see the node's log)")
    spool = st.get("spool")
    if spool:
        t.add_row("spool", f"{spool['records']:,} records, {_mb(spool['bytes'])}; "
                           f"uploading {spool.get('upload_rate_bps', 0) / 1e6:,.2f} MB/s"
                           + ("; stopping: uploading what it holds, refusing submits" if st.get("stopping") else ""))
    peers = ", ".join(f"{p['id']} ({p['role'] if p['role'] == 'origin' else p['region']}"
                      + (f", {p['uplink']:g} Mbit/s up" if p.get("uplink") else "")
                      + ((", snubbed: served too slowly lately" if p.get("snub_reason") == "slow"
                          else ", snubbed: sent no part of an answer lately") if p.get("snubbed") else "") + ")"
                      for p in st["peers"])
    t.add_row("peers", peers or "none")
    Console().print(t)
