"""What a call allocates: the peak of traced allocations (tracemalloc: Python objects and numpy)."""

from __future__ import annotations

import tracemalloc


def traced_peak(fn) -> int:
    """Run `fn()` and return the peak of what it allocated while tracing (its exceptions propagate)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
