"""What one TLS handshake costs a member's listener, with and without session tickets.

    .venv/bin/python bench/handshake.py [--handshakes 400] [--repeat 3]

A fresh swarm (node/net/trust.py: ECDSA P-256 certificates, TLS 1.3, both sides verified);
a listener thread with the server context and a client in this process dial each other on
loopback `--handshakes` times. Prints the listener thread's CPU per handshake (thread_time,
the best of `--repeat`), for the server context as members use it (no tickets) and with
OpenSSL's default of two tickets per handshake, which nobody resumes from.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import threading
import time
from pathlib import Path

from patchswarm.node.net import trust


def listener_cpu(server_ctx, client_ctx, n: int) -> float:
    """The listener thread's CPU seconds per handshake over `n` handshakes."""
    cpu = [0.0]
    with socket.create_server(("127.0.0.1", 0)) as ls:
        def serve() -> None:
            for _ in range(n):
                conn, _ = ls.accept()
                t0 = time.thread_time()
                with server_ctx.wrap_socket(conn, server_side=True) as s:
                    s.sendall(b"x")  # after the tickets, if any
                cpu[0] += time.thread_time() - t0

        t = threading.Thread(target=serve)
        t.start()
        for _ in range(n):
            with socket.create_connection(ls.getsockname()) as raw, client_ctx.wrap_socket(raw) as s:
                s.recv(1)
        t.join()
    return cpu[0] / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--handshakes", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        trust.init_swarm(root / "swarm")
        for name in ("listener", "dialer"):
            trust.issue(root / "swarm", name, "node", root / name)
        listener, dialer = trust.Credentials.load(root / "listener"), trust.Credentials.load(root / "dialer")
        client = trust.client_context(dialer)
        as_used = trust.server_context(listener)
        default = trust.server_context(listener)
        default.num_tickets = 2  # OpenSSL's default
        rows = {"no tickets (server_context)": as_used, "2 tickets (OpenSSL's default)": default}
        print(f"{a.handshakes} handshakes on loopback, best of {a.repeat}")
        print("listener context | listener CPU ms per handshake")
        for label, ctx in rows.items():
            best = min(listener_cpu(ctx, client, a.handshakes) for _ in range(a.repeat))
            print(f"{label} | {best * 1000:.2f}")


if __name__ == "__main__":
    main()
