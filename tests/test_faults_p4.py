"""A killed (SIGKILL) or stalled (sleeping) rank ends every other rank of a gloo job with a TransferFailed that
names the layer, the stage and the peer, within timeout_s + 10 s: ulysses, usp and torus on 2 processes, and
torus on 4 (2 x 2: Torus stages and ring passes, where some survivors lose a peer of a peer)."""
from __future__ import annotations

from streamfusion_diffusers.backends.watch import Label, stage
from streamfusion_diffusers.bench.faults import SLACK_S, Fault, Outcome, run_local_faults
from streamfusion_diffusers.core.mesh import Group

STAGES = {"ulysses": ("ulysses all-to-all",), "usp": ("ring pass",),
          "torus": ("pull_q", "pull_kv", "push_o")}


def check(fault: Fault, world: int, outcomes: list[Outcome]) -> None:
    assert [o.rank for o in outcomes] == [r for r in range(world) if r != fault.victim], outcomes
    for o in outcomes:
        assert o.status == "error" and o.message.startswith("TransferFailed: streamfusion: attention layer"), o
        assert any(stage in o.message for stage in STAGES[fault.method]), o
        assert o.after_fault_s is not None and o.after_fault_s <= fault.timeout_s + SLACK_S, o
    assert any(f"rank {fault.victim} failed" in o.message or f"rank {fault.victim}" in o.message
               for o in outcomes), outcomes


def test_every_survivor_names_the_fault(tmp_path):
    """Every case as its own job, the jobs side by side (each mostly waits for its timeout)."""
    cases = [(Fault(method, kind), 2) for method in STAGES for kind in ("kill", "stall")]
    cases.append((Fault("torus", "kill"), 4))
    for world in (2, 4):
        mine = [f for f, w in cases if w == world]
        for fault, outcomes in zip(mine, run_local_faults(mine, world, tmp_path / f"world{world}")):
            check(fault, world, outcomes)


def test_transfers_name_the_stage_and_the_global_ranks():
    ring = Group((0, 2, 4, 6), 1, None, "ring")  # this rank is 2; peers are positions in the group
    assert str(Label(3, ring, [2], "from", [0])) == "attention layer 3, ring pass from rank 4, sending to rank 0"
    with stage("pull_kv"):
        late = Label(5, Group((0, 4), 0, None, "torus"), [1], "from", [1])
    assert str(late) == "attention layer 5, pull_kv torus transfer from rank 4"  # the stage it was posted in
    assert str(Label(1, Group((0, 1, 2), 0, None, "ulysses_intra"))) == \
        "attention layer 1, ulysses all-to-all with ranks [1, 2]"
