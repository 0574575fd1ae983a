"""Layout resolution without any process: defaults, placements and the errors that name the fix."""
from __future__ import annotations

import itertools

import pytest

from streamfusion_diffusers import ParallelConfig
from streamfusion_diffusers.core.config import METHODS, resolve_layout


def layout(heads=24, world=8, **kw):
    return resolve_layout(ParallelConfig(**kw), world, heads)


def test_defaults_follow_the_paper():
    assert (layout(method="tas", machines=2).ulysses, layout(method="tas", machines=2).ring) == (8, 1)
    assert (layout(heads=6, method="tas", machines=2).ulysses, layout(heads=6, method="tas").ring) == (2, 4)
    torus = layout(method="torus", machines=2, ulysses=4)
    assert (torus.torus, torus.ulysses_intra, torus.ring) == (2, 2, 2)
    assert layout(method="torus", machines=1).torus == 8  # Torus inside one machine
    assert layout(method="torus", machines=4, ulysses=2).torus == 2  # gcd(N, U) when N does not divide U
    assert layout(method="usp", ring=2).ulysses == 4


def test_the_layout_is_chosen_unless_a_method_is_named():
    """As the command line: method "auto" by default, so no degree may be given without a method."""
    assert ParallelConfig().method == "auto"
    with pytest.raises(ValueError, match="method 'auto' chooses ulysses, ring and torus itself"):
        ParallelConfig(ulysses=2)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("machines", [1, 2, 4, 8])
def test_rank_coords_bijection_and_placement(method, machines):
    ulysses = {"ulysses": 8, "ring": 1}.get(method, 4)
    lay = layout(method=method, machines=machines, ulysses=ulysses if method not in ("ulysses", "ring") else None)
    coords = [lay.coords(r) for r in range(8)]
    assert sorted(coords) == sorted(itertools.product(range(lay.torus), range(lay.ulysses_intra), range(lay.ring)))
    assert all(lay.rank(*c) == r for r, c in enumerate(coords))
    m = lay.gpus_per_machine
    ring_machines = {lay.rank(0, 0, r) // m for r in range(lay.ring)}
    if method in ("tas", "torus") and lay.ring <= m:
        assert len(ring_machines) == 1  # TAS keeps the ring inside one machine
    if method == "usp" and lay.ring >= machines:
        assert len(ring_machines) == machines  # USP runs the ring across machines
    if method == "torus":
        torus_machines = {lay.rank(t, 0, 0) // m for t in range(lay.torus)}
        assert len(torus_machines) == min(lay.torus, machines)


@pytest.mark.parametrize("kw, heads, words", [
    (dict(method="tas", ulysses=16), 24, ["ulysses degree 16 does not divide 8 ranks", "[1, 2, 4, 8]"]),
    (dict(method="usp", ulysses=4, ring=4), 24, ["4 x 4 != 8"]),
    (dict(method="usp", ring=3), 24, ["ring=3 does not divide 8 ranks"]),
    (dict(method="tas", ulysses=8), 12, ["does not divide the 12 heads", "[1, 2, 4]"]),
    (dict(method="ulysses"), 12, ["'usp', 'tas' or 'torus' with ulysses in [1, 2, 4]"]),
    (dict(method="ring", ulysses=2), 24, ["method 'ring' uses ulysses=1"]),
    (dict(method="torus", ulysses=4, torus=3), 24, ["torus degree 3 does not divide ulysses degree 4"]),
    (dict(method="tas", torus=2), 24, ["only applies to method 'torus'"]),
    (dict(machines=3), 24, ["world size 8 is not machines x gpus_per_machine = 3 x 2"]),
])
def test_errors_name_the_fix(kw, heads, words):
    with pytest.raises(ValueError) as err:
        layout(heads=heads, **kw)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("kw", [dict(method="zigzag"), dict(backend="mpi"), dict(ring=0), dict(timeout_s=0),
                                dict(exchange_sms=-1)])
def test_bad_config_values(kw):
    with pytest.raises(ValueError):
        ParallelConfig(**kw)


def test_the_sms_left_to_an_exchange_are_set_around_the_work_beside_it_and_put_back():
    """cuBLAS's SM carveout holds inside `sms_left` only, also when the work raises; 0 leaves it untouched."""
    import torch

    from streamfusion_diffusers.attention.overlap import sms_left

    before = torch._C._get_sm_carveout_experimental()
    with sms_left(24):
        assert torch._C._get_sm_carveout_experimental() == 24
    assert torch._C._get_sm_carveout_experimental() == before
    with pytest.raises(RuntimeError), sms_left(16):
        raise RuntimeError("the projection failed")
    assert torch._C._get_sm_carveout_experimental() == before
    with sms_left(0):
        assert torch._C._get_sm_carveout_experimental() == before
