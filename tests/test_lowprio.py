"""node/lowprio.py: a blocking job on its own lower-priority thread, awaited from trio."""

import os
import threading

import pytest
import trio

from patchswarm.node.lowprio import run_low_priority


def _my_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_returns_the_result_on_a_lower_priority_thread_that_ends():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    seen = {}

    def job():
        seen["nice"] = _my_nice()
        seen["thread"] = threading.current_thread()
        child = {}
        t = threading.Thread(target=lambda: child.setdefault("nice", _my_nice()))
        t.start()
        t.join()
        seen["child"] = child["nice"]
        return 42

    assert trio.run(run_low_priority, job, 5) == 42
    assert seen["nice"] == min(19, base + 5)
    assert seen["child"] == seen["nice"]  # the state hash's helper threads inherit it
    assert not seen["thread"].is_alive()
    assert _my_nice() == base  # the caller's thread is untouched


def test_raises_what_the_job_raised():
    def job():
        raise ValueError("expected this")

    with pytest.raises(ValueError, match="expected this"):
        trio.run(run_low_priority, job)


def test_runs_to_the_end_when_the_caller_is_cancelled():
    release = threading.Event()
    finished = threading.Event()

    def job():
        release.wait(5)
        finished.set()

    async def main():
        timer = threading.Timer(0.3, release.set)  # long after the caller's deadline
        timer.start()
        with trio.move_on_after(0.05):
            await run_low_priority(job)
        done_on_return = finished.is_set()
        timer.join()
        return done_on_return

    # The cancelled wait still returned only once the job was done: in-place work is never abandoned.
    assert trio.run(main)


def test_zero_nice_keeps_the_priority():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert trio.run(run_low_priority, _my_nice, 0) == base
