"""Suite-wide settings: hypothesis without its per-example deadline; torch on one thread.

A deadline is a timed assert: on a loaded machine (several suites on two cores) an
example that takes 400 ms instead of 200 ms fails a test that checks correctness.
Speed is measured in bench/, not here.

One torch thread in the test processes (the processes tests start keep torch's default):
`make test` runs a pytest-xdist worker per core, and torch's default of a thread per core
in each worker puts twice as many spinning OpenMP threads as cores on the machine. The
synthetic checkpoints' training (tests/synthetic.py) then took 38 s instead of 4 s on
the 2-core VM with other jobs on it (2026-12-06); it was most of the two longest setups.
One thread is also what the demo's trainer and workers use, and its results do not
depend on the machine's core count.
"""

import torch
from hypothesis import settings

torch.set_num_threads(1)

settings.register_profile("patchswarm", deadline=None)
settings.load_profile("patchswarm")
