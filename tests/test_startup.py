"""A rank's start-up split by stage (runtime/startup.py): the stages in order, none negative, summing to the time
since the process began; a second build in one process reports its own stages only."""
import time
import types

import pytest

from streamfusion_diffusers.runtime import startup


@pytest.fixture(autouse=True)
def _fresh_marks(monkeypatch):
    monkeypatch.setattr(startup, "_marks", {})


def test_stages_in_order_sum_to_the_process_age():
    began = startup.process_started()
    assert began is not None and began <= time.time()  # Linux: from /proc
    for end in ("imported", "joined", "diffusers imported"):
        startup.mark(end)
        time.sleep(0.02)
    startup.mark("built")
    seconds = startup.split()
    assert list(seconds) == list(startup.STAGES)
    assert all(s >= 0.02 for s in list(seconds.values())[1:]) and seconds["process and imports"] > 0
    assert sum(seconds.values()) == pytest.approx(time.time() - began, abs=0.5)
    assert startup.describe(seconds).startswith("process and imports ")


def test_a_second_build_reports_its_own_stages(monkeypatch):
    now = [100.0]  # the marks' clock, moved by hand: the stages' seconds exact however loaded the machine
    monkeypatch.setattr(startup, "time", types.SimpleNamespace(time=lambda: now[0]))
    for end in ("imported", "joined", "diffusers imported", "built"):
        startup.mark(end)
        now[0] += 1.0
    now[0] += 50.0  # the process serves a while, then builds again
    startup.mark("diffusers imported")
    now[0] += 2.0
    startup.mark("built")
    assert startup.split() == {"build": 2.0}


def test_an_unknown_mark_is_refused():
    with pytest.raises(ValueError, match="one of imported, joined"):
        startup.mark("loaded")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def test_ranks_leave_at_once_after_the_job_rank_0_last(capfd):
    """A job that is over ends its rank processes without their teardown, and the rank hosting the store (0)
    goes last, so that no peer alive finds the store gone (torch logs "recvValue failed ... TCPStore" then)."""
    import threading

    from streamfusion_diffusers.runtime.pool import ProcessPool

    pool = ProcessPool(3)
    procs = list(pool._procs)
    assert pool.run(_rank) == [0, 1, 2]
    ended: dict[int, float] = {}

    def watch() -> None:
        while len(ended) < len(procs):
            for rank, proc in enumerate(procs):
                if rank not in ended and proc.exitcode is not None:
                    ended[rank] = time.monotonic()
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    began = time.monotonic()
    watcher.start()
    pool.close()
    watcher.join(10)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert max(ended.values()) - began < 2.0, ended  # no teardown of the interpreter or the process group
    assert ended[0] >= max(ended[1], ended[2]), ended
    assert "TCPStore" not in capfd.readouterr().err


_SEEN_AHEAD: dict[str, str | None] = {}


def _ahead() -> None:
    import os

    _SEEN_AHEAD["visible"] = os.environ.get("STREAMFUSION_TEST_VISIBLE")


def _what_ran_ahead() -> tuple[dict[str, str | None], bool]:
    import sys

    return dict(_SEEN_AHEAD), "diffusers" in sys.modules


@pytest.fixture
def spawned(monkeypatch):
    """Pools whose ranks are spawned (each a fresh interpreter: what `ahead` is for), not forked from the fork
    server, which imported the pipeline's modules already."""
    import torch.multiprocessing as mp

    from streamfusion_diffusers.runtime import fork_server

    monkeypatch.setattr(fork_server, "context", lambda: mp.get_context("spawn"))


def test_a_pool_starts_ahead_in_its_environment_before_the_join(spawned):
    """A job's ranks start `ahead` (the pipeline's imports) beside the join, after the pool's environment is set:
    CUDA reads CUDA_VISIBLE_DEVICES once, and an import that starts CUDA would read it before the join sets it."""
    from streamfusion_diffusers.runtime.pool import ProcessPool

    with ProcessPool(2, env={"STREAMFUSION_TEST_VISIBLE": "1"}, ahead=_ahead) as pool:
        assert pool.run(_what_ran_ahead) == [({"visible": "1"}, False)] * 2


def _imports_ahead() -> tuple[bool, bool]:
    import sys

    from streamfusion_diffusers.runtime import build

    assert build._ahead is not None
    build._ahead.join(120)
    return not build._ahead.is_alive(), "diffusers.models" in sys.modules


def test_a_job_pool_imports_the_pipeline_modules_ahead(spawned):
    from streamfusion_diffusers.runtime.build import import_ahead
    from streamfusion_diffusers.runtime.pool import ProcessPool

    with ProcessPool(2, ahead=import_ahead) as pool:
        assert pool.run(_imports_ahead) == [(True, True)] * 2


def _rank_sees() -> tuple[str | None, bool]:
    import os
    import sys

    return os.environ.get("STREAMFUSION_TEST_LATER"), "diffusers.models" in sys.modules


def test_cpu_ranks_start_imported_and_in_the_parents_environment_of_now(monkeypatch):
    """CPU ranks fork from a server that imported the pipeline's modules once (at the first pool of this process),
    and still see the parent's environment as it is when their pool starts, not as it was when the server did."""
    from streamfusion_diffusers.runtime.pool import ProcessPool

    with ProcessPool(2) as pool:
        pool.run(_rank_sees)
    monkeypatch.setenv("STREAMFUSION_TEST_LATER", "set after the first pool")
    with ProcessPool(2) as pool:
        assert pool.run(_rank_sees) == [("set after the first pool", True)] * 2


_EARLY = """
import sys
from multiprocessing import forkserver
from streamfusion_diffusers.runtime import fork_server
fork_server.start_early(sys.argv[1:])
print(getattr(forkserver._forkserver, "_forkserver_pid", None) is not None, "torch" in sys.modules)
"""


@pytest.mark.parametrize(("argv", "started"), [(["serve", "--model", "tiny-flux"], True),
                                               (["-v", "generate", "--cpu"], True),
                                               (["generate", "--help"], False), (["plan", "--model", "flux-dev"], False),
                                               (["bench"], False)])
def test_the_command_starts_its_fork_server_before_importing_torch(argv, started):
    """`streamfusion generate|serve` starts the ranks' fork server first thing, before the command itself imports
    torch (the package imports neither), so that the server's imports run beside the command's; other commands,
    --help and a launched rank start none."""
    import os
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _EARLY, *argv], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "RANK"})
    assert run.stdout.split() == [str(started), "False"], run.stderr
    launched = subprocess.run([sys.executable, "-c", _EARLY, *argv], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "RANK": "0"})
    assert launched.stdout.split() == ["False", "False"], launched.stderr


def test_the_warm_up_line_says_where_its_time_went():
    from streamfusion_diffusers.runtime.group import warmup_split

    record = {"step_latency_s": [2.31, 0.52], "one_time_s": {"kernel choice": 1.24, "layout choice": 0.31},
              "phases_s": {"text_encoding": 0.05, "denoising": 2.83, "decode": 0.3, "total": 3.2}}
    assert warmup_split(record, True) == (": first step 2.3 s (kernel choice 1.2 s, layout choice 0.3 s), the capture "
                                          "0.5 s, text encoding 0.1 s, decode 0.3 s")
    assert "second step 0.5 s" in warmup_split(record, False) and warmup_split(None, True) == ""


def test_a_refused_command_leaves_no_fork_server_behind(tmp_path):
    """The fork server starts before the arguments are checked; a command refused with one line (exit 2) ends it
    as it exits, so nothing of it runs on."""
    import contextlib
    import os
    import subprocess
    import sys

    import psutil

    def servers() -> set[int]:
        return {p.pid for p in psutil.process_iter(["cmdline"])
                if "multiprocessing.forkserver" in " ".join(p.info["cmdline"] or [])}

    before = servers()
    err = tmp_path / "stderr"
    with err.open("w") as stderr:  # a file, not a pipe: a server left behind would hold a pipe open, run() wait on it
        run = subprocess.run([sys.executable, "-m", "streamfusion_diffusers", "generate", "--model", "no-such-model"],
                             stdout=subprocess.DEVNULL, stderr=stderr, timeout=120,
                             env={k: v for k, v in os.environ.items() if k != "RANK"})
    said = err.read_text()
    assert run.returncode == 2 and said.count("\n") == 1 and "invalid choice" in said, said
    left = servers() - before
    for pid in left:  # a server's last moments after its parent's exit
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).wait(timeout=1)
    assert not servers() - before
