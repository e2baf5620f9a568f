"""Running a member as a service: the common arguments, logging, readiness to systemd, clean stop on signals.

Shared by the node, the origin and the tracker (tracker/cli.py), so it lives
in the network layer everyone may import. Owns the arguments every service
has (`--config`, `--log-format`, `--metrics`, `-v`; members also `--creds`,
`--listen`, `--advertise`), running `await start(task_status=...)` until
SIGINT/SIGTERM with the HTTP exporter beside it, telling systemd READY=1 once
the service is up (`Type=notify`), the warning for an address nobody else can
reach, and turning a nursery's exception group into the one error a person
should see.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import socket
import time
from importlib import metadata
from pathlib import Path

from patchswarm.node.net.config import add_config_argument
from patchswarm.node.net.logs import FORMATS, event, setup_logging
from patchswarm.node.net.transport import parse_addr
from patchswarm.protocol.errors import PatchswarmError, UsageError
from patchswarm.protocol import wire


def package_version() -> str:
    try:
        return metadata.version("patchswarm")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def address(text: str) -> str:
    """An argparse type: HOST:PORT (or [V6]:PORT), checked now rather than when the service dials or binds."""
    try:
        parse_addr(text)
    except UsageError as e:  # its message names the expected form
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def parse_region_rates(text: str | None) -> dict[str, float] | None:
    """An argparse type (the node's and the tracker's --wan-rates): REGION=MBIT[,REGION=MBIT...],
    each region's WAN link rate in Mbit/s, each region once; '' or 'none': not known."""
    if text is None or text.strip().lower() in ("", "none"):
        return None
    out = {}
    for item in text.split(","):
        region, eq, rate = item.strip().partition("=")
        region = region.strip()
        try:
            value = float(rate)
        except ValueError:
            value = None
        if not eq or not region or value is None or not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"expected REGION=MBIT[,REGION=MBIT...] with rates > 0, found {item!r}")
        if region in out:
            raise argparse.ArgumentTypeError(f"expected each region once in REGION=MBIT[,REGION=MBIT...], "
                                             f"found {region!r} twice")
        out[region] = value
    return out


def parse_uplink(text: str | None) -> float | None:
    """An argparse type (--uplink-mbit): this member's uplink in Mbit/s, a number in
    (0, wire.MAX_UPLINK_MBIT]; '' or 'none': declares none."""
    if text is None or text.strip().lower() in ("", "none"):
        return None
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not wire.is_uplink(value):
        raise argparse.ArgumentTypeError(f"expected Mbit/s in (0, {wire.MAX_UPLINK_MBIT}], found {text!r}")
    return value


def add_uplink_argument(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--uplink-mbit", type=parse_uplink, metavar="MBIT",
                   help=f"this host's upload rate in Mbit/s, told to the tracker and through it to every member "
                        f"(wire revision 5; default: none declared). {what}")


def add_require_region_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--require-region", action="store_true",
                   help="refuse a peer whose certificate names no region (`swarm issue --region`), over TCP and "
                        "WebRTC, dialled or dialling; without it such a peer says its region in its Hello. A "
                        "certificate that names a region is good for that region only, either way")


def format_wan_rates(rates: dict[str, float]) -> str:
    """`rates` as --wan-rates takes them (REGION=MBIT,...), regions in name order."""
    return ",".join(f"{r}={v:g}" for r, v in sorted(rates.items()))


def add_service_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of every long-running service (the tracker's too)."""
    add_config_argument(p)
    p.add_argument("--metrics", metavar="HOST:PORT", type=address,
                   help="serve /metrics (Prometheus), /healthz and /readyz over HTTP here (default: off)")
    p.add_argument("--log-format", choices=FORMATS, default="text",
                   help="text: a line per event with local date, time and UTC offset; json: one object per line "
                        "(UTC timestamp, level, event, message, fields) (default text)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def add_member_arguments(p: argparse.ArgumentParser, listen_default: str) -> None:
    """Arguments of the services that are swarm members (origin, node) and the tracker."""
    p.add_argument("--creds", metavar="OUT", required=True, type=Path,
                   help="credentials directory from `patchswarm swarm issue`")
    p.add_argument("--listen", metavar="HOST:PORT", default=listen_default, type=address,
                   help=f"address to accept connections on (default {listen_default}; port 0 picks one)")
    add_service_arguments(p)


def add_advertise_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--advertise", metavar="HOST:PORT", type=address,
                   help="the address peers should dial, as told to the tracker (default: the --listen address; "
                        "a wildcard host there is replaced by the address the tracker sees)")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: only a resolver knows, and a warning must not wait on one


def loopback_warning(advertised: str, tracker: str) -> str | None:
    """Why peers could not reach a member that advertises `advertised` to `tracker`, or None."""
    host, port = parse_addr(advertised)
    if _is_loopback(host) and not _is_loopback(parse_addr(tracker)[0]):
        return (f"advertising {advertised} to tracker {tracker}: a loopback address that no other host can dial; "
                f"give --listen 0.0.0.0:PORT or --advertise HOST:PORT with this host's reachable address")
    return None


def sd_notify(state: str) -> bool:
    """Tell the service manager `state` (e.g. READY=1) over $NOTIFY_SOCKET; False where there is none.

    The protocol is one datagram on a Unix socket (sd_notify(3)); a name starting
    with @ is in the abstract namespace.
    """
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.settimeout(1.0)  # a datagram to a live manager does not block; a dead one must not hang us
            s.sendto(state.encode(), path)
    except OSError as e:
        logging.getLogger("patchswarm").warning("could not notify the service manager at %s: %s",
                                                os.environ["NOTIFY_SOCKET"], e)
        return False
    return True


# A node's wait on a stop for its spool's records to reach the origin (`drain` below, --drain-s):
# under the 30 s notice a spot instance gets on GCP and Azure (AWS gives 2 min), and Kubernetes'
# default grace period (deploy/ gives the services room for it).
DRAIN_S = 20.0


def run_service(name: str, start, args: argparse.Namespace, metrics=None, pages=None, reload=None,
                drain=None) -> int:
    """Run `await start(task_status=...)` until SIGINT/SIGTERM; 0 on a clean stop.

    `start` reports its service's status function through `task_status.started`;
    with `--metrics`, the exporter (node/net/exporter.py) serves from before the
    service starts (/readyz answers 503 meanwhile) with `metrics` (a
    StatusMetrics) and `pages` (extra routes). With `reload`, SIGHUP calls it
    (on the event loop; what it raises is logged, and the service goes on);
    without, SIGHUP keeps its default action. With `drain`, the first SIGINT or
    SIGTERM awaits it (it bounds its own time) before the service is cancelled,
    and a second one cuts it short.
    """
    import trio

    setup_logging(name, args.verbose, args.log_format)
    log = logging.getLogger("patchswarm")
    caught = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGHUP,) if reload is not None else ())

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            with trio.open_signal_receiver(*caught) as signals:
                exporter = None
                if args.metrics:
                    from patchswarm.node.net.exporter import Exporter

                    exporter = Exporter(metrics, pages)
                    await nursery.start(exporter.run, args.metrics)
                status = await nursery.start(start)
                if exporter is not None:
                    exporter.attach(status)
                sd_notify("READY=1")
                async for signum in signals:
                    if signum == signal.SIGHUP:
                        sd_notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}")
                        try:
                            reload()
                        except (PatchswarmError, OSError) as e:
                            log.error("SIGHUP: kept the configuration in use: %s", e)
                        sd_notify("READY=1")
                        continue
                    log.info("stopping (%s)", signal.Signals(signum).name,
                             extra=event("stopping", signal=signal.Signals(signum).name))
                    sd_notify("STOPPING=1")
                    if drain is not None:
                        await _drain_until_signal(drain, signals, log)
                    nursery.cancel_scope.cancel()
                    break

    try:
        trio.run(main)
    except BaseExceptionGroup as group:
        raise _sole(group) from None
    return 0


async def _drain_until_signal(drain, signals, log: logging.Logger) -> None:
    """`await drain()`, unless another SIGINT or SIGTERM comes first (SIGHUP is ignored
    meanwhile: the service is stopping)."""
    import trio

    async with trio.open_nursery() as nursery:
        async def second_signal() -> None:
            async for signum in signals:
                if signum != signal.SIGHUP:
                    log.info("stopping now (%s again)", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    return

        nursery.start_soon(second_signal)
        await drain()
        nursery.cancel_scope.cancel()


def _sole(group: BaseExceptionGroup) -> BaseException:
    """The one real error inside nested nursery groups (what a person should see), else the group."""
    leaves = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for x in e.exceptions:
                walk(x)
        else:
            leaves.append(e)

    walk(group)
    return leaves[0] if len(leaves) == 1 else group
