"""FP8 inter-machine transfers (4 gloo processes): close to the exact result on every method and mesh, and
bit-identical to plain transfers where no chunk crosses a machine."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from sp_cases import Problem, reference, run_rank

from streamfusion_diffusers import ParallelConfig
from streamfusion_diffusers.backends.fp8 import FP8_MAX, dequantize, quantize
from streamfusion_diffusers.spawn import ProcessPool

WORLD = 4
METHODS = ("ulysses", "ring", "usp", "tas", "torus")
FP8_TOL = 5e-2  # e4m3 keeps 3 mantissa bits: about 2-3 % rms rounding per element


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD) as p:
        yield p


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm())


def _outputs(pool, config: ParallelConfig, problem: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    results = pool.run(run_rank, config, problem)
    return torch.cat([out for out, _ in results], dim=1), results[0][1]


def test_quantize_round_trip():
    x = torch.randn(3, 5, 4, 64) * torch.logspace(-3, 3, 5).view(1, 5, 1, 1)
    x[0, 0, 0] = 0.0  # an all-zero row must not divide by zero
    data, scale = quantize(x)
    assert data.dtype == torch.uint8 and data.shape == x.shape and scale.shape == x.shape[:-1]
    assert torch.equal(data.view(torch.float8_e4m3fn).float().abs().amax(-1)[1:], torch.full((2, 5, 4), FP8_MAX))
    back = dequantize(data, scale, torch.empty_like(x))
    assert torch.equal(back[0, 0, 0], x[0, 0, 0])
    assert ((back - x).abs() <= x.abs().amax(-1, keepdim=True) * 2.0 ** -4).all()  # e4m3: half an ulp of 2^-3
    assert _rel(back, x.double()) < 3e-2


# (mesh, method, ulysses degree) -> whether some exchange (Torus stage or ring pass) crosses machines; Ulysses
# all-to-alls are left as they are, so ulysses, and tas with its ring inside a machine, stay exact
CASES = {
    ((2, 2), "ulysses", None): False, ((2, 2), "ring", None): True, ((2, 2), "usp", 2): True,
    ((2, 2), "tas", 2): False, ((2, 2), "torus", None): True, ((2, 2), "torus", 2): True,
    ((4, 1), "ring", None): True, ((4, 1), "usp", 2): True, ((4, 1), "tas", 2): True, ((4, 1), "torus", None): True,
}


@pytest.mark.parametrize(("mesh", "method", "ulysses"), CASES, ids=lambda c: str(c))
def test_fp8_across_machines_is_close(pool, mesh, method, ulysses):
    config = ParallelConfig(machines=mesh[0], gpus_per_machine=mesh[1], method=method, ulysses=ulysses)
    problem = Problem(heads=8, head_dim=32, batch=1, seq_lens=(48, 40, 48, 56), joint=8)
    ref, ref_joint = reference(problem)
    plain, _ = _outputs(pool, config, problem)
    fp8, fp8_joint = _outputs(pool, dataclasses.replace(config, comm_dtype="fp8"), problem)
    err, err_plain, err_joint = _rel(fp8, ref), _rel(plain, ref), _rel(fp8_joint, ref_joint)
    print(f"\n{mesh[0]}x{mesh[1]} {method} U{ulysses or '-'}: fp8 rel err {err:.2e} (joint rows {err_joint:.2e}), "
          f"plain {err_plain:.1e}")
    assert err_plain < 1e-5 and err <= FP8_TOL and err_joint <= FP8_TOL
    assert (err > 10 * err_plain) == CASES[(mesh, method, ulysses)], (err, err_plain)


@pytest.mark.parametrize("method", METHODS)
def test_fp8_on_one_machine_is_bit_identical(pool, method):
    config = ParallelConfig(machines=1, gpus_per_machine=WORLD, method=method)
    problem = Problem(heads=8, head_dim=16, batch=2, seq_lens=(16, 24, 16, 8), joint=4)
    plain, plain_joint = _outputs(pool, config, problem)
    fp8, fp8_joint = _outputs(pool, dataclasses.replace(config, comm_dtype="fp8"), problem)
    assert torch.equal(plain, fp8) and torch.equal(plain_joint, fp8_joint)


def test_bad_comm_dtype_names_the_choices():
    with pytest.raises(ValueError, match="comm_dtype 'int4' is not one of None, 'fp8'"):
        ParallelConfig(comm_dtype="int4")
