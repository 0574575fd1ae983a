"""A rank's start-up split by stage (runtime/startup.py): the stages in order, none negative, summing to the time
since the process began; a second build in one process reports its own stages only."""
import time

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


def test_a_second_build_reports_its_own_stages():
    for end in ("imported", "joined", "diffusers imported", "built"):
        startup.mark(end)
    time.sleep(0.05)  # the process serves a while, then builds again
    startup.mark("diffusers imported")
    startup.mark("built")
    seconds = startup.split()
    assert list(seconds) == ["build"] and seconds["build"] < 0.05


def test_an_unknown_mark_is_refused():
    with pytest.raises(ValueError, match="one of imported, joined"):
        startup.mark("loaded")
