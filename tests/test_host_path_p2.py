"""The eager attention path stays lean, and one rank placement runs one path whatever its method's name.

Over 2 gloo processes, a Flux transformer parallelized by each layout (bench/host_path.py, as
benchmarks/host_path.py measures it): ulysses, usp U2R1 and tas U2R1 place the ranks alike, so their attention
calls run the very same Python functions in the same order, on one mesh; and an attention call from diffusers'
dispatch_attention_fn, after warm-up, stays under a bound on Python function calls (389 before the per-shape plan
and the direct transfers, 78 after: per-call work creeping back fails here); so does what a whole parallelized
forward adds to plain diffusers' (313 calls over 584 before the hooks kept their layouts, slices and FBC lead
blocks per size, 176 after).
"""
from __future__ import annotations

import pytest

from streamfusion_diffusers import ParallelConfig, init_parallel
from streamfusion_diffusers.bench.host_path import Shape, run_rank
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.core.mesh import GroupCache

MAX_ATTENTION_CALLS = 90  # Python calls per attention call (78 measured), with margin
MAX_BLOCK_OVERHEAD = 90  # Python calls a parallelized block adds to plain diffusers' (69 measured)
MAX_FORWARD_OVERHEAD = 185  # Python calls a parallelized whole forward adds to plain diffusers' (176 measured)


@pytest.fixture(scope="module")
def measured():
    with ProcessPool(2) as pool:
        yield pool.run(run_rank, ["ulysses", "usp:U2R1", "tas:U2R1"], Shape(), 2)


def test_one_placement_runs_one_path(measured):
    for plain, *layouts in measured:
        first = layouts[0].attention.functions
        assert first, "no attention call was counted"
        for m in layouts[1:]:
            assert m.attention.functions == first, (m.label, layouts[0].label)
            assert (m.joint_block.python, m.single_block.python) == (layouts[0].joint_block.python,
                                                                     layouts[0].single_block.python), m.label


def test_attention_call_stays_lean(measured):
    for plain, *layouts in measured:
        for m in layouts:
            assert m.attention.python <= MAX_ATTENTION_CALLS, (m.label, m.attention.python)
            for block, base in ((m.joint_block, plain.joint_block), (m.single_block, plain.single_block)):
                assert block.python - base.python <= MAX_BLOCK_OVERHEAD, (m.label, block.python, base.python)


def _meshes() -> tuple[bool, str]:
    groups = GroupCache()
    meshes = [init_parallel(ParallelConfig(method=method, ulysses=2 if method != "ulysses" else None), groups=groups
                            ).mesh(None) for method in ("ulysses", "usp", "tas")]
    return all(m is meshes[0] for m in meshes), meshes[0].layout.method


def test_one_placement_shares_one_mesh():
    with ProcessPool(2) as pool:
        for same, method in pool.run(_meshes):
            assert same and method == "ulysses", (same, method)


def test_whole_forward_stays_lean(measured):
    """The hooks around the forward (split, gather, layout, masks, cache agreement) and two attention calls."""
    for plain, *layouts in measured:
        for m in layouts:
            assert m.forward.python - plain.forward.python <= MAX_FORWARD_OVERHEAD, (m.label, m.forward.python,
                                                                                     plain.forward.python)
