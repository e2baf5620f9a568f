"""Microbenchmark of the piece picker: the cost of its facts and of `requests()`, as the daemon drives it.

One node of a 10-node region fetching a patch from 9 region peers, the origin
and remote peers in three regions. Prints one row per case: `add_object`, per
Have index, per `requests()` call, per reply + HaveOne. CPU time of this
thread, so that a busy shared machine inflates it less.

Run: `python bench/picker.py`. Importing this module does no work.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from patchswarm.protocol.picker import NODE, ORIGIN, PiecePicker  # noqa: E402

KEY = (7, False)
OR = "origin"



def bench_case(n_chunks, n_peers, held, calls=20000, seed=1):
    """One node of a 10-node region fetching a patch from 9 region peers, the
    origin and remote peers in three regions, each holding a random `held`
    share; one reply and one HaveOne between requests() calls, as the daemon
    would drive it. Returns the timings, in this thread's CPU time so that a
    busy shared machine inflates them less."""
    rng = random.Random(seed)
    remote = n_peers - 10
    members = {f"l{i}": "r1" for i in range(10)} | {f"w{i}": f"r{2 + i % 3}" for i in range(remote)}
    others = sorted(set(members) - {"l0"})
    p = PiecePicker("l0", "r1", "r0", seed=seed)
    p.set_members(members)
    for peer in others:
        p.peer_joined(peer, NODE, members[peer])
    p.peer_joined(OR, ORIGIN, "r0")
    t0 = time.thread_time()
    p.add_object(KEY, n_chunks, now=0.0)
    t1 = time.thread_time()
    haves = [(peer, rng.sample(range(n_chunks), int(n_chunks * held))) for peer in others]
    t2 = time.thread_time()
    p.peer_has(OR, KEY, range(n_chunks))
    for peer, chunks in haves:
        p.peer_has(peer, KEY, chunks)
    t3 = time.thread_time()
    inflight, t_req, t_fact, made = [], 0.0, 0.0, 0
    for i in range(calls):
        t = time.thread_time()
        reqs = p.requests(i * 1e-4)
        t_req += time.thread_time() - t
        made += len(reqs)
        inflight += reqs
        r = inflight.pop(rng.randrange(len(inflight))) if inflight else None
        peer, c = rng.choice(others), rng.randrange(n_chunks)
        t = time.thread_time()
        if r is not None:
            p.chunk_received(r.key, r.chunk, r.peer)
        p.peer_has(peer, KEY, [c])
        t_fact += time.thread_time() - t
        if p.complete(KEY):
            break
    n_indices = n_chunks + sum(len(chunks) for _, chunks in haves)
    return dict(add_ms=(t1 - t0) * 1e3, have_us=(t3 - t2) / n_indices * 1e6,
                req_us=t_req / (i + 1) * 1e6, fact_us=t_fact / (i + 1) * 1e6,
                calls=i + 1, made=made)


def bench_keyframe(n_chunks, regions=10, per_region=100, repeat=3):
    """`add_object` of a keyframe of `n_chunks` (a 500 GB checkpoint in 1 MiB chunks: 500,000)
    among `regions` x `per_region` members: wall ms per call, best and worst of `repeat`, as the
    event loop feels it (the collector's passes included, which thread time would hide)."""
    members = {f"n{r}.{i}": f"r{r}" for r in range(regions) for i in range(per_region)}
    times = []
    for k in range(repeat):
        p = PiecePicker("n1.0", "r1", "r0", seed=k, wan_gateways=2)
        p.set_members(members)
        for m, r in members.items():
            if m != "n1.0":
                p.peer_joined(m, NODE, r)
        p.peer_joined(OR, ORIGIN, "r0")
        t = time.perf_counter()
        p.add_object((KEY[0], True), n_chunks, now=0.0)
        times.append((time.perf_counter() - t) * 1e3)
        del p
    return min(times), max(times)


def bench():
    print("keyframe chunks  members  add_object wall ms (best, worst of 3)")
    for n in (50_000, 500_000):
        lo, hi = bench_keyframe(n)
        print(f"{n:15d} {1000:8d}  {lo:8.1f} {hi:8.1f}")
    print()
    print("chunks  peers  held   add_object  per Have index  requests()  reply+HaveOne  calls  requests")
    for n_chunks, n_peers, held in [(5000, 30, 1 / 3), (10000, 30, 1 / 3), (10000, 50, 1 / 3),
                                    (10000, 30, 1.0), (10000, 30, 0.02)]:
        r = bench_case(n_chunks, n_peers, held)
        print(f"{n_chunks:6d} {n_peers:6d} {held:5.2f} {r['add_ms']:9.1f}ms {r['have_us']:13.2f}µs "
              f"{r['req_us']:9.1f}µs {r['fact_us']:12.1f}µs {r['calls']:6d} {r['made']:9d}")


if __name__ == "__main__":
    bench()
