"""The Gluon Hopper kernel builds with the installed triton, on a machine without a GPU.

Gluon's API still moves between triton releases (3.7 renamed the bulk tensor load), and the kernel only runs on a
Hopper GPU, so this compiles it ahead of time for sm_90a and checks that the schedule is the one it is written to
be: tensor-core products issued asynchronously, registers moved between warpgroups (warp specialization), no
spills, and shared memory within the 227 KB a Hopper block may hold; for every variant the kernel is built in (a
variant that fails to build falls back on its own, kernels/fused.py, so each is checked here). About 30 s on 2
cores with an empty triton cache. tests/test_kernels_gpu.py runs it.
"""
from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")

if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 6):
    pytest.skip("the Gluon kernel needs triton >= 3.6", allow_module_level=True)


def _build(dim: int, load_state: bool, finalize: bool, dtype: str) -> object:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from streamfusion_diffusers.kernels import gluon_attention as ga

    elem = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    signature = {"x_base": f"*{dtype}", "f_base": "*fp32", "q_table": "*i64", "kv_table": "*i64", "n_q": "i32",
                 "n_kv": "i32", "n_tiles": "i32", "heads": "i32", "qk_scale": "fp32"}
    constants = dict(BLOCK_M=ga.BLOCK_M, BLOCK_N=ga.BLOCK_N, HEAD_DIM=dim, STAGES=ga.STAGES,
                     Q_LAYOUT=gl.NVMMASharedLayout.get_default_for([ga.BLOCK_M // 2, dim], elem),
                     KV_LAYOUT=gl.NVMMASharedLayout.get_default_for([ga.BLOCK_N, dim], elem),
                     LOAD_STATE=load_state, FINALIZE=finalize)
    signature.update(dict.fromkeys(constants, "constexpr"))
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    source = GluonASTSource(ga._multi_chunk_attention, signature, constants, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=ga.MAXNREG))


# Every build fused.Variant names: both head dims, state loaded or not, finalized or not (each its own build,
# each its own fallback); bfloat16 for all, float16 (another element type in the same code) once.
VARIANTS = [(dim, load_state, finalize, "bf16") for dim in (64, 128) for load_state in (False, True)
            for finalize in (False, True)] + [(128, True, True, "fp16")]


@pytest.mark.parametrize("dim, load_state, finalize, dtype", VARIANTS)
def test_gluon_kernel_builds_for_hopper(dim: int, load_state: bool, finalize: bool, dtype: str) -> None:
    kernel = _build(dim, load_state, finalize, dtype)
    ptx = kernel.asm["ptx"]
    assert ptx.count("wgmma.mma_async") >= 4  # Q K^T and P V, in both consumer warpgroups
    assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)  # S_i waited for while P V runs
    assert "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx  # consumers take the loader's registers
    assert "cp.async.bulk.tensor" in ptx  # K and V come through TMA
    assert ".local" not in ptx  # nothing spilled to local memory
    assert kernel.metadata.shared <= 227 * 1024
