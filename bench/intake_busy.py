"""What a refused trajectory batch costs the origin, and how fast chunks are served meanwhile.

One origin (in process, on loopback, mutual TLS) whose trajectory intake has no
free slot (INTAKE_BATCHES_TOTAL set to 0, as when a stuck store holds them all)
and `--nodes` sessions of wire revision 3, each sending `--batches` incompressible
trajectory batches of `--batch-mib` MiB back to back, as fast as the link takes
them, while asking for a 1 MiB chunk after each batch. Every batch is answered
TrajectoriesBusy and dropped; every chunk request must be answered meanwhile.

Prints: batches refused per second and MB/s read and dropped; the origin's CPU
per refused batch (this process's CPU time, both ends of every connection, so an
upper bound); the peak of Python memory (tracemalloc) above the start, against
the stated bound (the frames being read, at most MAX_BUFFERED_BYTES over all
connections, and nothing held after the answer); chunk answers p50 / max ms.

With `--old` the sessions offer only wire revision 2 (nodes of the previous
version, and what every node got before revision 3): the origin stops reading a
session at its first batch, and the run ends after `--seconds` with the chunks
answered until then.

    .venv/bin/python bench/intake_busy.py --nodes 4 --batches 25 --batch-mib 4 [--old]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from patchswarm.node.net import trust  # noqa: E402
from patchswarm.node.net.transport import connect  # noqa: E402
from patchswarm.node.trainer import origin as origin_mod  # noqa: E402
from patchswarm.protocol import wire  # noqa: E402
from patchswarm.protocol.trajectory import Record, encode_batch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--batches", type=int, default=25)
    p.add_argument("--batch-mib", type=float, default=4.0)
    p.add_argument("--old", action="store_true", help="sessions of wire revision 2: no TrajectoriesBusy")
    p.add_argument("--seconds", type=float, default=30.0, help="the run ends after this, done or not")
    a = p.parse_args()
    origin_mod.INTAKE_BATCHES_TOTAL = 0  # every batch finds no slot
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        trust.init_swarm(tmp / "swarm")
        trust.issue(tmp / "swarm", "origin", "origin", tmp / "origin")
        names = [f"n{i}" for i in range(a.nodes)]
        for name in names:
            trust.issue(tmp / "swarm", name, "node", tmp / name)
        cfg = origin_mod.OriginConfig(tracker="127.0.0.1:9", creds=tmp / "origin", key=tmp / "swarm" / "trainer.key",
                                      data_dir=tmp / "data", listen="127.0.0.1:0")
        per_record = 64 << 10
        n_records = max(1, int(a.batch_mib * (1 << 20)) // per_record)
        result = trio.run(_run, cfg, tmp, names, a.batches, n_records, per_record, a.old, a.seconds)
    refused, wall, cpu, peak, chunk_ms, batch_bytes = result
    asked = a.nodes * a.batches
    head = (f"{a.nodes} sessions ({'revision 2' if a.old else 'revision 3'}) x {a.batches} batches of "
            f"{batch_bytes / 2**20:.1f} MiB, {wall:.2f} s: ")
    if not refused:
        print(head + f"no batch refused; {len(chunk_ms)} of {asked} chunk requests answered")
        return
    print(head + f"{refused} refused ({refused / wall:.0f} batches/s, {refused * batch_bytes / wall / 1e6:.0f} MB/s "
          f"read and dropped); CPU {cpu / refused * 1e3:.1f} ms per refused batch (both ends); Python memory peak "
          f"+{peak / 2**20:.0f} MiB; {len(chunk_ms)} of {asked} chunk requests answered, p50 "
          f"{statistics.median(chunk_ms):.0f} ms, max {max(chunk_ms):.0f} ms")


async def _run(cfg, tmp, names, batches, n_records, per_record, old, seconds):
    o = origin_mod.Origin(cfg)
    async with trio.open_nursery() as n:
        await n.start(o.run)
        version = await o.publish({"w": torch.randn(1 << 19)})  # 1 MiB served (bf16): one chunk
        key = (version, True)
        streams = []
        for name in names:
            creds = trust.Credentials.load(tmp / name)
            ctx = trust.client_context(creds)
            if old:
                ctx.set_alpn_protocols(["patchswarm/2"])
            streams.append(await connect(o.listen_addr, creds, {"origin"}, wire.Hello(name, "r1", "node", "127.0.0.1:1", []),
                                         expect_name="origin", ssl_context=ctx))
        payloads = {name: wire.Trajectories(encode_batch([Record(name, "r1", s, 0, 1.0, os.urandom(per_record))
                                                          for s in range(n_records)])) for name in names}
        batch_bytes = len(payloads[names[0]].batch)
        chunk_ms: list[float] = []
        refused = [0]
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        cpu0, t0 = time.process_time(), time.perf_counter()

        async def node(ms, name):
            asked: list[float] = []
            async with trio.open_nursery() as inner:
                async def reader():
                    busy = 0
                    while busy < batches or asked:
                        msg = await ms.receive()
                        if isinstance(msg, wire.TrajectoriesBusy):
                            busy += 1
                            refused[0] += 1
                        elif isinstance(msg, wire.Piece) and msg.offset + len(msg.data) == msg.total:
                            chunk_ms.append((time.perf_counter() - asked.pop(0)) * 1e3)
                inner.start_soon(reader)
                for _ in range(batches):
                    await ms.send(payloads[name])
                    asked.append(time.perf_counter())
                    await ms.send(wire.Request(key[0], key[1], 0))

        with trio.move_on_after(seconds):
            async with trio.open_nursery() as nodes:
                for ms, name in zip(streams, names):
                    nodes.start_soon(node, ms, name)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        for ms in streams:
            await ms.aclose()
        n.cancel_scope.cancel()
    return refused[0], wall, cpu, peak, chunk_ms, batch_bytes


if __name__ == "__main__":
    main()
