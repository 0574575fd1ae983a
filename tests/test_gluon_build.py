"""The Gluon Hopper kernel builds with the installed triton, on a machine without a GPU.

Gluon's API still moves between triton releases (3.7 renamed the bulk tensor load), and the kernel only runs on a
Hopper GPU, so this compiles it ahead of time for sm_90a and checks that the schedule is the one it is written to
be: tensor-core products issued asynchronously, registers moved between warpgroups (warp specialization), no
spills, and shared memory within the 227 KB a Hopper block may hold. tests/test_kernels_gpu.py runs it.
"""
from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")

if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 6):
    pytest.skip("the Gluon kernel needs triton >= 3.6", allow_module_level=True)


def _build(dim: int, load_state: bool) -> object:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from streamfusion_diffusers.kernels import gluon_attention as ga

    signature = {"x_base": "*bf16", "f_base": "*fp32", "q_table": "*i64", "kv_table": "*i64", "n_q": "i32",
                 "n_kv": "i32", "n_tiles": "i32", "heads": "i32", "qk_scale": "fp32"}
    constants = dict(BLOCK_M=ga.BLOCK_M, BLOCK_N=ga.BLOCK_N, HEAD_DIM=dim, STAGES=ga.STAGES,
                     Q_LAYOUT=gl.NVMMASharedLayout.get_default_for([ga.BLOCK_M // 2, dim], gl.bfloat16),
                     KV_LAYOUT=gl.NVMMASharedLayout.get_default_for([ga.BLOCK_N, dim], gl.bfloat16),
                     LOAD_STATE=load_state, FINALIZE=not load_state)
    signature.update(dict.fromkeys(constants, "constexpr"))
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    source = GluonASTSource(ga._multi_chunk_attention, signature, constants, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=ga.MAXNREG))


@pytest.mark.parametrize("dim, load_state", [(128, False), (64, True)])
def test_gluon_kernel_builds_for_hopper(dim: int, load_state: bool) -> None:
    kernel = _build(dim, load_state)
    ptx = kernel.asm["ptx"]
    assert ptx.count("wgmma.mma_async") >= 4  # Q K^T and P V, in both consumer warpgroups
    assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)  # S_i waited for while P V runs
    assert "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx  # consumers take the loader's registers
    assert "cp.async.bulk.tensor" in ptx  # K and V come through TMA
    assert ".local" not in ptx  # nothing spilled to local memory
    assert kernel.metadata.shared <= 227 * 1024
