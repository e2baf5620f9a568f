"""protocol/parallel.py: results in task order, the first error a serial loop would raise, every task waited for."""

import threading
import time

import pytest

from patchswarm.protocol import parallel


def test_results_come_back_in_task_order_from_several_threads():
    def task(i):
        def run():
            time.sleep(0.001 * (i % 3))  # finish out of order
            return i * i
        return run

    done = []
    assert parallel.run_all([task(i) for i in range(40)], threads=4, on_done=done.append) == [i * i for i in range(40)]
    assert done == list(range(1, 41))  # one call per task, counting up


def test_the_lowest_failing_task_is_the_error_raised_after_every_started_task_ends():
    finished = []

    def task(i):
        def run():
            if i in (5, 9):
                raise ValueError(f"task {i}")
            time.sleep(0.002)
            finished.append(i)
        return run

    with pytest.raises(ValueError, match="task 5"):
        parallel.run_all([task(i) for i in range(30)], threads=3)
    assert set(range(5)) <= set(finished)  # every task below the failure ran to its end
    time.sleep(0.01)
    count = len(finished)
    time.sleep(0.02)
    assert len(finished) == count  # nothing still running after run_all returned


def test_one_thread_or_no_tasks():
    assert parallel.run_all([], threads=8) == []
    assert parallel.run_all([lambda: threading.current_thread()], threads=1) == [threading.current_thread()]


def test_thread_counts_follow_work_cores_and_tasks(monkeypatch):
    monkeypatch.setattr(parallel, "cores", lambda: 4)
    assert parallel.threads_for(tasks=1, work=10**9, min_work_per_thread=1) == 1
    assert parallel.threads_for(tasks=10, work=100, min_work_per_thread=100) == 1
    assert parallel.threads_for(tasks=10, work=250, min_work_per_thread=100) == 2
    assert parallel.threads_for(tasks=3, work=10**9, min_work_per_thread=1) == 3
    assert parallel.threads_for(tasks=10, work=10**9, min_work_per_thread=1) == 4


def test_a_helper_that_wakes_after_the_call_returned_holds_nothing_of_its_work(monkeypatch):
    """A helper the scheduler starts only after run_all returned (the caller ran every task)
    must not be the last holder of the tasks or their results: freeing a tensor there while
    the process exits aborted it (CI: a follower process ended with -6 after its work)."""
    import gc
    import weakref

    class Payload:
        pass

    late = []  # helpers started only when this test says so
    monkeypatch.setattr(parallel._thread, "start_new_thread", lambda fn, args: late.append((fn, args)))
    inputs = [Payload() for _ in range(4)]
    refs = [weakref.ref(p) for p in inputs]

    def task(p):
        def run():
            out = Payload()
            refs.append(weakref.ref(out))
            return out, p
        return run

    results = parallel.run_all([task(p) for p in inputs], threads=3)
    assert [r[1] for r in results] == inputs and len(late) == 2
    was_enabled = gc.isenabled()
    gc.disable()  # reference counting alone must free them: no cycle through the job
    try:
        del results, inputs
        assert [r() for r in refs] == [None] * 8
    finally:
        if was_enabled:
            gc.enable()
    for fn, args in late:  # the late helpers find no task and end
        t = threading.Thread(target=fn, args=args)
        t.start()
        t.join(5)
        assert not t.is_alive()


@pytest.mark.slow  # fresh interpreters
def test_processes_that_hash_on_helper_threads_and_exit_at_once_all_exit_cleanly():
    """bench/exit_abort.py at its smallest: the real exit path after a threaded state hash."""
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench" / "exit_abort.py"
    out = subprocess.run([sys.executable, str(bench), "--runs", "3", "--loops", "1", "--burners", "1", "--threads", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "3 runs (1 loops of 3, 1 burners, threads 2)" in out.stdout, out.stdout + out.stderr
