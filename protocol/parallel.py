"""Independent pieces of one computation spread over the cores.

Owns `run_all(tasks, threads)`: the tasks run on the caller's thread and on
helper threads started by the call, each taking the next task until none is
left, so a thread the scheduler keeps waiting costs at most one
task, never a fixed share. It pays only where tasks spend their time outside
the interpreter lock: the codec's compiled kernels, BLAKE3 and most numpy
calls on large arrays release it.

Why threads started by the call (and not a pool kept between calls): the
caller decides the priority of the work (the node daemon applies at a lower
nice value, which new threads inherit and cached ones would not), and a
library that hands back control leaves no work running behind it (a helper
that starts after the last task was taken finds none and ends at once).

`gc_paused()` holds off the cyclic garbage collector around a computation
that makes an object or two per tensor of a state and keeps them to its end
(views, shapes, records): with a state of 140k tensors alive, those
allocations set off full collections that walk every object of the
process, a quarter of a state hash's time here.
Overlapping pauses (threads) keep it off until the last ends.

Errors: `run_all` waits for every task it started and raises the error of
the lowest-numbered task that failed, so the error is the one a loop in
task order would have raised first.
"""

from __future__ import annotations

import _thread
import contextlib
import gc
import os
import threading
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")

MAX_THREADS = 16


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_for(tasks: int, work: int, min_work_per_thread: int, limit: int | None = None) -> int:
    """How many threads `tasks` tasks of `work` units in all are worth:
    at most one per task and per core, each with at least `min_work_per_thread`,
    and at most `limit` when the caller sets one."""
    if tasks < 2 or work < 2 * min_work_per_thread:
        return 1
    return max(1, min(cores(), MAX_THREADS, tasks, work // min_work_per_thread, limit or MAX_THREADS))


_gc_lock = threading.Lock()
_gc_pauses = 0  # gc_paused blocks running now, in any thread
_gc_was_on = False  # the collector was on when the first of them began


@contextlib.contextmanager
def gc_paused():
    """The cyclic collector off for the block, if it was on (and on again after it).

    Reference counting still frees everything that is not in a cycle; cycles
    made meanwhile wait for the next collection. Blocks that overlap, nested or
    in other threads (a node's apply beside its manifest decode), keep it off
    until the last of them ends, then leave it as it was before the first: a
    block that ended first used to turn it on under the others."""
    global _gc_pauses, _gc_was_on
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_on = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_on:
                gc.enable()


class _Job:
    def __init__(self, tasks: Sequence[Callable[[], T]], on_done: Callable[[int], None] | None):
        self.tasks = tasks
        self.results: list = [None] * len(tasks)
        self.errors: dict[int, BaseException] = {}
        self._on_done = on_done
        self._cond = threading.Condition()
        self._count = len(tasks)
        self._issued = 0
        self._busy = 0  # tasks being run
        self._done = 0
        self._failed = False

    def _take(self) -> int | None:
        with self._cond:
            # After a failure no task is started: every task below it has been taken already.
            if self._failed or self._issued >= self._count:
                return None
            self._issued += 1
            self._busy += 1
            return self._issued - 1

    def work(self) -> None:
        while (i := self._take()) is not None:
            try:
                self.results[i] = self.tasks[i]()
                failed = False
            except BaseException as e:  # re-raised by the caller in run_all
                self.errors[i] = e
                failed = True
            with self._cond:
                self._busy -= 1
                self._failed |= failed
                if not failed:
                    self._done += 1
                    if self._on_done is not None:
                        self._on_done(self._done)
                if self._busy == 0:
                    self._cond.notify_all()

    def wait(self) -> None:
        """Until no task is running; called once the caller's own `work` found none left to take."""
        with self._cond:
            while self._busy:
                self._cond.wait()

    def release(self) -> tuple[list, dict[int, BaseException]]:
        """The results and errors, the job's references to them, to the tasks and to `on_done`
        dropped (after `wait`: no task is left to take).

        Why: a helper that wakes only now still holds the job until it ends. Had the job
        kept these, the helper could be the last holder of the tasks' tensors and free
        them as the process exits; freeing a tensor releases the interpreter lock, and a
        thread that takes it back during finalization is ended by `pthread_exit`, whose
        unwinding through torch's C++ frames aborts the process ("terminate called
        without an active exception", exit -6)."""
        with self._cond:
            results, errors = self.results, self.errors
            self.tasks = self.results = self.errors = self._on_done = None
        return results, errors


def run_all(tasks: Sequence[Callable[[], T]], threads: int = 1,
            on_done: Callable[[int], None] | None = None) -> list[T]:
    """Every task's result, in task order; `threads` counts the caller's own.

    `on_done(n)` is called (on whichever thread finished one, one call at a
    time) after each task with the number finished so far.
    """
    job = _Job(tasks, on_done)
    # Not threading.Thread: its start() waits until the new thread runs, and on
    # a virtual machine waking an idle core took 1-2 ms here, as long as a
    # whole task. A helper that starts after the caller has taken every task
    # finds none and ends; run_all waits only for tasks being run.
    for _ in range(max(0, min(threads, len(tasks)) - 1)):
        _thread.start_new_thread(job.work, ())
    try:
        job.work()
    finally:
        job.wait()
        results, errors = job.release()
    if errors:
        raise errors[min(errors)]
    return results
