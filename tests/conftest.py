"""Suite-wide settings: hypothesis without its per-example deadline; torch on one thread.

A deadline is a timed assert: on a loaded machine (several suites on two cores) an
example that takes 400 ms instead of 200 ms fails a test that checks correctness.
Speed is measured in bench/, not here.

One torch thread in the test processes (the processes tests start keep torch's default):
`make test` runs a pytest-xdist worker per core, and torch's default of a thread per core
in each worker puts twice as many spinning OpenMP threads as cores on the machine: the
synthetic checkpoints' training (tests/synthetic.py) made test_hostile_member's setup take
153 s and test_node_durability's 125 s (`pytest -n 2 --durations=80`, 2026-12-06, the 2-core
VM with other jobs on it; 4.8 s and 2.0 s with one thread: bench/RESULTS.md, Tests). One
thread is also what the demo's trainer and workers use, and its results do not depend on the
machine's core count.
"""

import torch
from hypothesis import settings

torch.set_num_threads(1)

settings.register_profile("patchswarm", deadline=None)
settings.load_profile("patchswarm")


def pytest_collection_modifyitems(items):
    """Each module's `slow` tests (real processes, 5-60 s each), spread over the first three
    quarters of the run between whole modules' worth of the other tests; the last quarter is
    short tests.

    pytest-xdist hands out tests in collection order, and in file order the longest ones
    (test_trajectories, test_wan_small, test_webrtc_*) came last: one worker finished 77 s
    before the other (bench/RESULTS.md, Tests). Spread, the slow tests (which mostly wait on
    their processes) run beside CPU-bound short ones, and short tests fill the end of the run
    on both workers. A module's tests of each kind stay together, so its module-scoped
    fixtures are made about as often as before. Every worker computes the same order.
    """
    slow: dict = {}  # a module's path: its slow tests
    fast = []
    for item in items:
        if item.get_closest_marker("slow"):
            slow.setdefault(item.path, []).append(item)
        else:
            fast.append(item)
    if not slow or not fast:
        return
    order, at = [], 0
    for k, module_tests in enumerate(slow.values(), 1):
        order.extend(module_tests)
        end = 3 * len(fast) * k // (4 * len(slow))
        while 0 < end < len(fast) and fast[end].path == fast[end - 1].path:
            end += 1  # to the end of that module
        order.extend(fast[at:end])
        at = max(at, end)
    order.extend(fast[at:])
    assert len(order) == len(items)
    items[:] = order
