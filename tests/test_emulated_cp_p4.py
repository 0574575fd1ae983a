"""diffusers' context-parallel collectives over the emulated link (bench/emulated_cp.py), on 4 gloo ranks as 4
machines x 1: each one's result is torch's, and its bytes to and from the other machine are booked on the
emulated NIC (counted, and waited for at the link's pace) as our transport books its own; diffusers reaches the
proxy only while `over_emulated_link` is entered."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from streamfusion_diffusers.backends.emulated import EmulatedNic
from streamfusion_diffusers.bench.emulated_cp import BookedCollectives, over_emulated_link
from streamfusion_diffusers.core.links import parse_link
from streamfusion_diffusers.runtime.pool import ProcessPool

SLOW = "0.001:20000"  # 1 MB/s and 20 ms a message: the booking dominates a tiny transfer


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(4) as p:
        yield p


def _collectives() -> dict:
    rank = dist.get_rank()
    nic = EmulatedNic(parse_link(SLOW), 1, rank, torch.device("cpu"))
    booked = BookedCollectives(funcol, nic)
    group = dist.group.WORLD
    x = torch.arange(12, dtype=torch.float32) + 100 * rank  # 3 values (12 bytes) to each of the 4 ranks
    started = time.perf_counter()
    moved = funcol.wait_tensor(booked.all_to_all_single(x, None, None, group))
    seconds = time.perf_counter() - started
    gathered = funcol.wait_tensor(booked.all_gather_tensor(x[:2], 0, group))
    from diffusers.models import attention_dispatch
    with over_emulated_link(nic) as inside:
        patched = attention_dispatch.funcol is inside
    expected = funcol.wait_tensor(funcol.all_to_all_single(x, None, None, group))
    gathered_expected = funcol.wait_tensor(funcol.all_gather_tensor(x[:2], 0, group))
    return {"moved": moved.tolist(), "expected": expected.tolist(), "gathered": gathered.tolist(),
            "gathered_expected": gathered_expected.tolist(),
            "counted": (nic.counted.sent_bytes, nic.counted.sent_messages, nic.counted.received_bytes),
            "seconds": seconds, "patched": patched, "restored": attention_dispatch.funcol is funcol}


def test_booked_collectives_give_torchs_results_and_pay_the_link(pool):
    for res in pool.run(_collectives):
        assert res["moved"] == res["expected"] and res["gathered"] == res["gathered_expected"], res
        # the all-to-all: 12 bytes to each of the 3 other machines' ranks; the all-gather: 8 bytes to each of them
        assert res["counted"] == (60, 6, 60), res
        assert res["seconds"] >= 0.06, res  # three messages each way at 20 ms (the two queues run side by side)
        assert res["patched"] and res["restored"], res
