"""Suite-wide settings: hypothesis without its per-example deadline.

A deadline is a timed assert: on a loaded machine (several suites on two cores) an
example that takes 400 ms instead of 200 ms fails a test that checks correctness.
Speed is measured in bench/, not here.
"""

from hypothesis import settings

settings.register_profile("patchswarm", deadline=None)
settings.load_profile("patchswarm")
