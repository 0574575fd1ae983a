"""The watchdog thread ends a process whose GPU transfer is late, naming it, before torch's NCCL watchdog would
speak with no names: exit code EXIT_CODE, one critical line, every thread's stack. On the CPU the late transfer is
a CUDA event that never completes (an object with the event's `query()`), in a process of its own."""
from __future__ import annotations

import subprocess
import sys

from streamfusion_diffusers.backends.watchdog import EXIT_CODE

SCRIPT = """
import logging, time
from streamfusion_diffusers.backends.watchdog import Watchdog

class NeverDone:  # a CUDA event whose work never completes
    def query(self):
        return False

logging.basicConfig()
dog = Watchdog(poll_s=0.01)
dog.watch(NeverDone(), "attention layer 3, ulysses all-to-all", time.monotonic() - 10.0, 2.0)
time.sleep(20)  # the watchdog thread ends the process long before
"""


def test_a_late_gpu_transfer_ends_the_process_naming_it():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_CODE, done.stderr[-2000:]
    assert "attention layer 3, ulysses all-to-all did not complete within 2 s" in done.stderr, done.stderr[-2000:]
    assert "ending this process" in done.stderr and "Thread" in done.stderr, done.stderr[-2000:]


def test_a_deadline_names_the_transfer_while_the_watchdog_is_blocked_in_a_cuda_call():
    """A per-case deadline (commands/timing.py) that expires while the watchdog thread is stuck in a CUDA event's
    query (behind a full launch queue, holding its lock) still says what the GPU waits for, at once."""
    import threading
    import time

    from streamfusion_diffusers.backends.watchdog import Watchdog, waiting_line

    release, returned = threading.Event(), threading.Event()

    class Stuck:  # a CUDA event whose query blocks, as one behind a full launch queue
        def query(self) -> bool:
            release.wait(30)
            returned.set()
            return False

    dog = Watchdog(poll_s=0.01)
    try:
        dog.watch(Stuck(), "attention layer 7, ulysses all-to-all", time.monotonic() - 4.0, 600.0)
        time.sleep(0.1)  # the thread is in query() now, holding the lock
        line = waiting_line()
        assert not returned.is_set()  # said while the query still blocks, not after it
        assert line.startswith("the GPU waits for attention layer 7, ulysses all-to-all, posted 4."), line
    finally:
        release.set()
        dog.close()


def test_the_waiting_line_says_what_completed_last_and_how_many_wait_behind():
    import time

    from streamfusion_diffusers.backends.watchdog import Watchdog, waiting_line

    class Done:
        def query(self) -> bool:
            return True

    class Pending:
        def query(self) -> bool:
            return False

    dog = Watchdog(poll_s=0.01)
    try:
        dog.watch(Done(), "attention layer 6, end of layer", time.monotonic() - 3.0, 600.0)
        dog.watch(Pending(), "attention layer 7, ring pass from rank 3", time.monotonic() - 2.0, 600.0)
        dog.watch(Pending(), "attention layer 7, end of layer", time.monotonic() - 1.0, 600.0)
        deadline = time.monotonic() + 5
        while dog.last_done is None and time.monotonic() < deadline:  # the thread's next look
            time.sleep(0.01)
        line = waiting_line()
        assert line.startswith("the GPU waits for attention layer 7, ring pass from rank 3, posted 2."), line
        assert line.endswith("(the last seen complete: attention layer 6, end of layer); 1 more pending behind it"), \
            line
    finally:
        dog.close()
