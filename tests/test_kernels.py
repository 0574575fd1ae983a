"""CPU tests of the attention kernels: the LSE merge, the chunked API, and (with triton installed) the fused
and merge Triton kernels run by Triton's CPU interpreter. Inputs are fresh random draws on every run."""
from __future__ import annotations

import logging
import math
import os
import subprocess
import sys

import pytest
import torch

from streamfusion_diffusers.core.exactness import reference_attention, relative_error, threshold
from streamfusion_diffusers.kernels.attend import attend_chunks, attention_with_lse
from streamfusion_diffusers.kernels.merge import merge_into_reference
from streamfusion_diffusers.kernels.partial import Partial
from streamfusion_diffusers.kernels.reference import attention_with_lse_reference


def _rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype)


def _chunks(total: int, cuts: list[int]) -> list[slice]:
    edges = [0, *cuts, total]
    return [slice(a, b) for a, b in zip(edges, edges[1:])]


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_merge_reference_equals_attention_over_the_union(dtype: torch.dtype, tol: float) -> None:
    b, h, d, lq, lk = 2, 3, 16, 9, 40
    q, k, v = _rand(b, lq, h, d, dtype=dtype), _rand(b, lk, h, d, dtype=dtype), _rand(b, lk, h, d, dtype=dtype)
    scale = d ** -0.5
    parts = [attention_with_lse_reference(q, k[:, s], v[:, s], scale) for s in _chunks(lk, [7, 8, 31])]
    out, lse = parts[0][0].clone(), parts[0][1].clone()
    for new_out, new_lse in parts[1:]:
        merge_into_reference(out, lse, new_out, new_lse)
    ref_out, ref_lse = attention_with_lse_reference(q, k, v, scale)
    assert relative_error(out, reference_attention(q, k, v)) < tol
    assert (lse - ref_lse).abs().max() < tol  # a log: its absolute error is the sum's relative one


def test_merge_reference_with_empty_state_is_a_copy() -> None:
    out, lse = torch.zeros(1, 5, 2, 8), torch.full((1, 2, 5), float("-inf"))
    new_out, new_lse = _rand(1, 5, 2, 8), _rand(1, 2, 5)
    merge_into_reference(out, lse, new_out, new_lse)
    assert torch.equal(out, new_out) and torch.equal(lse, new_lse)


def _attend_in_steps(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_cuts: list[int],
                     kv_cuts: list[int], steps: list[int]) -> list[torch.Tensor]:
    """Query chunks (head-sliced views) attend to key/value chunks, steps[i] of them in call i, the last
    call finalizing."""
    heads = slice(1, 1 + q.shape[2] // 2)
    q_views = [q[:, s, heads] for s in _chunks(q.shape[1], q_cuts)]
    kv = [(k[:, s, heads], v[:, s, heads]) for s in _chunks(k.shape[1], kv_cuts)]
    assert sum(steps) == len(kv)
    partials = [Partial() for _ in q_views]
    for i, n in enumerate(steps):
        start = sum(steps[:i])
        attend_chunks(partials, q_views, kv[start:start + n], kernel=kernel, finalize=i == len(steps) - 1)
    return [p.result(q.dtype) for p in partials]


def _check_chunked(kernel: str, dtype: torch.dtype) -> None:
    b, h, d, lq, lk = 2, 4, 64, 77, 150
    q, k, v = _rand(b, lq, h, d).to(dtype), _rand(b, lk, h, d).to(dtype), _rand(b, lk, h, d).to(dtype)
    outs = _attend_in_steps(kernel, q, k, v, q_cuts=[5, 40], kv_cuts=[33, 34, 101, 149], steps=[1, 3, 1])
    heads = slice(1, 1 + h // 2)
    ref = reference_attention(q[:, :, heads], k[:, :, heads], v[:, :, heads])
    assert outs[0].dtype == dtype
    assert relative_error(torch.cat(outs, dim=1), ref) <= threshold(dtype)


def test_attend_chunks_reference_is_exact() -> None:
    _check_chunked("reference", torch.float32)


def test_partial_rejects_chunks_after_finalize_and_results_before_any() -> None:
    q, k = _rand(1, 4, 2, 8), _rand(1, 6, 2, 8)
    p = Partial()
    with pytest.raises(RuntimeError):
        p.result(torch.float32)
    attend_chunks([p], [q], [(k, k)], kernel="reference", finalize=True)
    with pytest.raises(RuntimeError):
        attend_chunks([p], [q], [(k, k)], kernel="reference")


def test_empty_chunks_are_skipped() -> None:
    q, k, v = _rand(1, 6, 2, 8), _rand(1, 5, 2, 8), _rand(1, 5, 2, 8)
    p, empty = Partial(), Partial()
    attend_chunks([p, empty], [q, q[:, :0]], [(k[:, :0], v[:, :0]), (k, v)], kernel="reference")
    assert empty.out is None
    assert relative_error(p.result(torch.float32), reference_attention(q, k, v)) <= threshold(torch.float32)


def test_sdpa_final_call_joins_the_key_chunks_without_lse() -> None:
    """Queries that see every key at once take one SDPA call over the joined chunks (no LSE, no merge)."""
    q, k, v = _rand(2, 7, 3, 16), _rand(2, 11, 3, 16), _rand(2, 11, 3, 16)
    parts, rows = [Partial(), Partial()], _chunks(7, [4])
    cols = _chunks(11, [3, 9])
    attend_chunks(parts, [q[:, r] for r in rows], [(k[:, c], v[:, c]) for c in cols], kernel="sdpa", finalize=True)
    out = torch.cat([p.result(torch.float32) for p in parts], 1)
    assert all(p.final and p.lse is None for p in parts)
    assert relative_error(out, reference_attention(q, k, v)) <= threshold(torch.float32)


# --- Triton kernels in Triton's CPU interpreter -------------------------------------------------------------
# The interpreter must be chosen before triton is imported, so the tests below run in a child pytest with
# TRITON_INTERPRET=1, started by test_triton_kernels_in_the_interpreter (skipped only without triton).

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreter_only = pytest.mark.skipif(not INTERPRETING, reason="run by test_triton_kernels_in_the_interpreter")


def test_triton_kernels_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    if INTERPRETING:
        pytest.skip("already in the interpreter")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "interpreted"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-4000:]


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Work around triton 3.6's interpreter calling int() on 1-element arrays, which numpy >= 2.4 rejects."""
    import triton.runtime.interpreter as interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)


@interpreter_only
@pytest.mark.parametrize("use_tma", [False, True])
def test_fused_kernel_interpreted(interpreted: None, use_tma: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # float16 only: the interpreter reads bfloat16 through raw addresses wrongly (bfloat16 runs in the GPU tests).
    from streamfusion_diffusers.kernels import triton_attention

    # Small tiles, so chunk lengths are not multiples of them and several tiles and chunks are crossed.
    small = triton_attention.TileConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, use_tma=use_tma)
    monkeypatch.setitem(triton_attention.DEFAULT_CONFIGS, 64, small)
    _check_chunked("fused", torch.float16)


@interpreter_only
def test_fused_single_chunk_lse_interpreted(interpreted: None) -> None:
    q, k, v = (_rand(1, n, 2, 128).to(torch.float16) for n in (70, 90, 90))
    out, lse = attention_with_lse(q, k, v, kernel="fused")
    ref_lse = attention_with_lse_reference(q, k, v, 128 ** -0.5)[1]
    assert out.dtype == torch.float16 and relative_error(out, reference_attention(q, k, v)) <= threshold(torch.float16)
    assert (lse - ref_lse).abs().max() < 1e-3  # a log: its absolute error is the sum's relative one


@pytest.fixture
def e4m3_rounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cast float32 to float8 e4m3 in the interpreter as GPUs do, to nearest even (torch's cast): the
    interpreter's own cast loses the carry of a mantissa rounded up, halving such values at every other
    exponent."""
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    convert = interpreter._convert_float

    def converted(x, src, dst, rounding):
        if (src, dst) != (tl.float32, tl.float8e4nv):
            return convert(x, src, dst, rounding)
        return torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()

    monkeypatch.setattr(interpreter, "_convert_float", converted)


@interpreter_only
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize(("kernel", "tol"), [("int8", 2.5e-2), ("fp8", 4e-2)])
def test_quantized_attention_interpreted(interpreted: None, e4m3_rounded: None, kernel: str, tol: float,
                                         dim: int) -> None:
    """The 8-bit kernels against float64 softmax attention at fresh lengths (the keys never whole blocks), keys
    far from a zero mean (what the smoothing is for): the output; the log-sum-exp, the smoothing's shift added
    back, fp8's bit for bit int8's (P is quantized after the softmax's sums); two query chunks against the two
    key halves merged by their log-sum-exps as a ring pass merges them. int8, its P V in half precision, is the
    more accurate, hence its tighter bound."""
    lq, lk = torch.randint(40, 300, (2,)).tolist()
    lk += lk % 64 == 0
    q = (2 * torch.randn(2, lq, 2, dim)).half()
    k = (torch.randn(2, lk, 2, dim) + 3).half()
    v = torch.randn(2, lk, 2, dim).half()
    scale = dim ** -0.5
    want, want_lse = attention_with_lse_reference(q.double(), k.double(), v.double(), scale)
    out, lse = attention_with_lse(q, k, v, scale=scale, kernel=kernel)
    assert out.dtype == torch.float16 and relative_error(out, want) <= tol
    assert (lse - want_lse).abs().max() <= 8e-2  # a log: the int8 scores' error, the shift's is far larger
    if kernel == "fp8":
        assert torch.equal(lse, attention_with_lse(q, k, v, scale=scale, kernel="int8")[1])
    parts, rows, cols = [Partial(), Partial()], _chunks(lq, [lq // 2]), _chunks(lk, [lk // 2])
    attend_chunks(parts, [q[:, r] for r in rows], [(k[:, c], v[:, c]) for c in cols], scale, kernel, finalize=True)
    assert relative_error(torch.cat([p.result(torch.float64) for p in parts], 1), want) <= tol


def test_quantized_attention_is_refused_where_it_cannot_run() -> None:
    """On the CPU (no interpreter) the 8-bit kernels are refused in one line naming what they need."""
    if INTERPRETING:
        pytest.skip("the interpreter runs them")
    q = torch.randn(1, 8, 2, 64).half()
    with pytest.raises(ValueError, match="kernel 'int8' needs triton, a GPU of compute capability 8.0"):
        attention_with_lse(q, q, q, kernel="int8")


@interpreter_only
def test_triton_merge_interpreted(interpreted: None) -> None:
    from streamfusion_diffusers.kernels.triton_merge import merge_into_triton

    b, lq, h, d = 2, 70, 3, 64
    out, lse = _rand(b, lq, h, d), _rand(b, h, lq)
    new_out = _rand(b, h, lq, d).to(torch.bfloat16).transpose(1, 2)  # strided, as SDPA returns it
    new_lse = _rand(b, h, lq + 10)[..., :lq]
    want_out, want_lse = out.clone(), lse.clone()
    merge_into_reference(want_out, want_lse, new_out, new_lse)
    merge_into_triton(out, lse, new_out, new_lse)
    assert relative_error(out, want_out) < 1e-5 and (lse - want_lse).abs().max() < 1e-5
    assert math.isfinite(out.sum().item())


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_qk_interpreted(interpreted: None, dtype: torch.dtype) -> None:
    """The one-pass rotary embedding gives diffusers' apply_rotary_emb (more rows than one block holds, and a
    last block only partly full): bit for bit in float32; in bfloat16 within one unit in the last place, since
    the interpreter casts float32 to bfloat16 by truncation where GPUs round to nearest even
    (tests/test_kernels_gpu.py checks the bits there)."""
    from diffusers.models.embeddings import apply_rotary_emb

    from streamfusion_diffusers.kernels.triton_rotary import rotary_qk_triton

    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(2, 37, 3, 32, generator=g).to(dtype) for _ in range(2))
    cos, sin = (torch.randn(37, 32, generator=g) for _ in range(2))
    for x, got in zip((q, k), rotary_qk_triton(q, k, cos, sin)):
        want = apply_rotary_emb(x, (cos, sin), sequence_dim=1)
        assert got.dtype == dtype
        if dtype == torch.float32:
            assert torch.equal(got, want)
        else:
            ulp = want.float().abs() * 2.0 ** -7  # bfloat16 keeps 8 significant bits
            assert ((got.float() - want.float()).abs() <= ulp).all()


def test_rotary_qk_runs_diffusers_where_the_pass_does_not_fit() -> None:
    """Off CUDA (and for shapes the pass does not take) q and k go through diffusers' own function."""
    from diffusers.models.embeddings import apply_rotary_emb

    from streamfusion_diffusers.kernels.rotary import rotary_qk

    g = torch.Generator().manual_seed(6)
    q, k = (torch.randn(1, 5, 2, 6, generator=g) for _ in range(2))
    freqs = (torch.randn(5, 6, generator=g), torch.randn(5, 6, generator=g))
    for x, got in zip((q, k), rotary_qk(q, k, freqs)):
        assert torch.equal(got, apply_rotary_emb(x, freqs, sequence_dim=1))


def test_rotary_qk_that_does_not_build_says_so_once_and_runs_diffusers(monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A one-pass RoPE that fails to compile on a device costs one warning; diffusers' function runs there from
    then on, without trying again. A launch fault that is not a build failure is raised, not hidden."""
    from diffusers.models.embeddings import apply_rotary_emb

    from streamfusion_diffusers.kernels import rotary

    tries: list[int] = []

    def unbuildable(*args: object) -> None:
        tries.append(1)
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(rotary, "_fits", lambda *args: True)
    monkeypatch.setattr(rotary, "_one_pass", lambda: unbuildable)
    monkeypatch.setattr(rotary, "_unbuilt", set())
    g = torch.Generator().manual_seed(7)
    q, k = (torch.randn(1, 5, 2, 6, generator=g) for _ in range(2))
    freqs = (torch.randn(5, 6, generator=g), torch.randn(5, 6, generator=g))
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            got = rotary.rotary_qk(q, k, freqs)
            assert torch.equal(got[0], apply_rotary_emb(q, freqs, sequence_dim=1))
    assert tries == [1] and sum("did not build" in r.message for r in caplog.records) == 1

    def faulty(*args: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(rotary, "_one_pass", lambda: faulty)
    monkeypatch.setattr(rotary, "_unbuilt", set())
    with pytest.raises(RuntimeError, match="illegal memory access"):
        rotary.rotary_qk(q, k, freqs)


def test_a_gluon_variant_that_does_not_build_falls_back_alone(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A variant (dtype, head dim, state loaded, finalized) whose Gluon build fails costs one warning and runs the
    portable kernel from then on; a variant that builds keeps Gluon, whichever launched first; a launch fault that
    is not a build failure is raised, not hidden."""
    pytest.importorskip("triton")
    from triton.compiler.errors import CompilationError

    from streamfusion_diffusers.kernels import fused

    calls: list[str] = []

    def gluon(q_chunks: list[torch.Tensor], *args: object) -> None:
        calls.append(f"gluon {q_chunks[0].shape[-1]}")
        if q_chunks[0].shape[-1] == 128:
            raise CompilationError(None, None, "async_copy_global_to_shared has been removed")

    monkeypatch.setattr(fused, "_launched", {})
    monkeypatch.setattr(fused, "kernel_for", lambda device, variant=None: gluon)
    monkeypatch.setattr(fused, "_portable", lambda: lambda q_chunks, *args: calls.append(
        f"triton {q_chunks[0].shape[-1]}"))
    q64, q128 = (torch.zeros(1, 4, 1, d, dtype=torch.float16) for d in (64, 128))
    with caplog.at_level("WARNING", logger=fused.__name__):
        for q in (q64, q128, q128, q64):
            fused.multi_chunk_attention([q], [(q, q)], [(None, q)], [q], 1.0, True)
    assert calls == ["gluon 64", "gluon 128", "triton 128", "triton 128", "gluon 64"]
    assert len([r for r in caplog.records if "does not build" in r.getMessage()]) == 1

    def faulty(*args: object) -> None:
        raise ValueError("an illegal address")

    monkeypatch.setattr(fused, "_launched", {})
    monkeypatch.setattr(fused, "kernel_for", lambda device, variant=None: faulty)
    with pytest.raises(ValueError, match="illegal address"):
        fused.multi_chunk_attention([q64], [(q64, q64)], [(None, q64)], [q64], 1.0, True)
    assert not fused._launched


def _fake_sdpa(refusing: dict[str, BaseException], tried: list[str]):
    """An SDPA `_call` whose backends in `refusing` raise their error; the others compute attention (float32)."""

    def call(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
             lse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        tried.append(backend)
        if backend in refusing:
            raise refusing[backend]
        out, lse_ = attention_with_lse_reference(*(x.transpose(1, 2) for x in (q, k, v)), scale)
        return out.transpose(1, 2), lse_

    return call


# What torch's SDPA kernels raise for an input a backend does not take (flash_api.cpp's and attention.cu's
# TORCH_CHECKs, cuDNN frontend's plan search, F.scaled_dot_product_attention's selection, a build without the op)
REFUSALS = {
    "cudnn-no-plan": RuntimeError("cuDNN Frontend error: [cudnn_frontend] Error: No execution plans support the "
                                  "graph."),
    "cudnn-status": RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"),
    "flash-gpu": RuntimeError("FlashAttention only supports Ampere GPUs or newer."),
    "flash-dtype": RuntimeError("FlashAttention only support fp16 and bf16 data type"),
    "flash-head-dim": RuntimeError("FlashAttention forward only supports head dimension at most 256"),
    "flash-build": RuntimeError("USE_FLASH_ATTENTION was not enabled for build."),
    "no-kernel": RuntimeError("No available kernel. Aborting execution."),
    "no-op": NotImplementedError("Could not run 'aten::_scaled_dot_product_cudnn_attention' with arguments from "
                                 "the 'CPU' backend."),
}


@pytest.mark.parametrize("error", REFUSALS.values(), ids=REFUSALS.keys())
def test_an_sdpa_backend_that_refuses_an_input_is_skipped_for_that_shape_only(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, error: RuntimeError) -> None:
    from streamfusion_diffusers.kernels import sdpa

    tried: list[str] = []
    monkeypatch.setattr(sdpa, "_call", _fake_sdpa({"cudnn": error}, tried))
    monkeypatch.setattr(sdpa, "_unsupported", set())
    q, k, v = _rand(1, 9, 2, 16), _rand(1, 13, 2, 16), _rand(1, 13, 2, 16)
    other = _rand(1, 10, 2, 16)
    with caplog.at_level("WARNING", logger=sdpa.__name__):
        out, _ = sdpa.attention_with_lse_sdpa(q, k, v, 0.25)
        sdpa.attention_with_lse_sdpa(q, k, v, 0.25)  # the same shape: cuDNN is not asked again
        sdpa.attention_with_lse_sdpa(other, k, v, 0.25)  # another shape: cuDNN is asked first again
    assert tried == ["cudnn", "flash", "flash", "cudnn", "flash"]
    assert relative_error(out, reference_attention(q, k, v, 0.25)) <= threshold(torch.float32)
    refused = [r.getMessage() for r in caplog.records if "does not take" in r.getMessage()]
    assert len(refused) == 2 and "[1, 9, 2, 16]" in refused[0] and "[1, 10, 2, 16]" in refused[1], refused


@pytest.mark.parametrize("error", [RuntimeError("CUDA error: an illegal memory access was encountered"),
                                   RuntimeError("CUDA error: operation not supported"),
                                   RuntimeError("expected scalar type Half but found Float")],
                         ids=["fault", "cuda-not-supported", "bad-argument"])
def test_any_other_sdpa_error_is_raised_and_switches_no_backend(monkeypatch: pytest.MonkeyPatch,
                                                                 error: RuntimeError) -> None:
    from streamfusion_diffusers.kernels import sdpa

    tried: list[str] = []
    monkeypatch.setattr(sdpa, "_call", _fake_sdpa({"cudnn": error}, tried))
    monkeypatch.setattr(sdpa, "_unsupported", set())
    q = _rand(1, 9, 2, 16)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=str(error)):
            sdpa.attention_with_lse_sdpa(q, q, q, 0.25)
    assert tried == ["cudnn", "cudnn"] and not sdpa._unsupported


def test_out_of_memory_is_raised_with_the_sizes_and_switches_no_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """An SDPA backend that runs out of memory is not a backend that rejects the input: the error reaches the
    caller with the sizes and a hint, and the backend is still tried next time (no process-wide switch)."""
    from streamfusion_diffusers.kernels import sdpa

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    monkeypatch.setattr(sdpa, "_call", out_of_memory)
    monkeypatch.setattr(sdpa, "_unsupported", set())
    q, k = _rand(1, 300, 2, 64), _rand(1, 5000, 2, 64)
    with pytest.raises(torch.OutOfMemoryError, match="300 queries over 5000 keys .* more ranks"):
        sdpa.attention_with_lse_sdpa(q, k, k, 0.125)
    assert sdpa._unsupported == set()


# --- edge inputs: one ValueError on the host, before any kernel runs, whichever kernel was asked for ---------------

def _edge_inputs() -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]]:
    q, k = _rand(1, 6, 2, 64).half(), _rand(1, 5, 2, 64).half()
    return {"empty keys": (q, k[:, :0], k[:, :0], "no keys"),
            "empty queries": (q[:, :0], k, k, "no queries"),
            "heads": (q, _rand(1, 5, 1, 64).half(), k, "one batch, head count and head dim"),
            "head dim": (q, k, _rand(1, 5, 2, 32).half(), "one batch, head count and head dim"),
            "batch": (q, _rand(2, 5, 2, 64).half(), _rand(2, 5, 2, 64).half(), "one batch"),
            "dtype": (q, k.float(), k, "one dtype"),
            "key and value rows": (q, k, k[:, :4], "each key needs its value"),
            "not 4-D": (q[0], k[0], k[0], r"\[B, L, H, D\]")}


@pytest.mark.parametrize("kernel", ["reference", "sdpa", "fused", "auto"])
@pytest.mark.parametrize("case", list(_edge_inputs()))
def test_edge_inputs_are_refused_on_every_kernel_path(case: str, kernel: str, monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    from streamfusion_diffusers.kernels import fused, sdpa

    def launched(*args: object, **kwargs: object) -> None:
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(sdpa, "_call", launched)
    monkeypatch.setattr(fused, "multi_chunk_attention", launched)
    q, k, v, message = _edge_inputs()[case]
    with pytest.raises(ValueError, match=message):
        attention_with_lse(q, k, v, kernel=kernel)


@pytest.mark.parametrize("kernel", ["reference", "sdpa", "fused", "auto"])
def test_attend_chunks_refuses_mismatched_chunks_and_a_strided_state(kernel: str) -> None:
    q, k = _rand(1, 6, 2, 64).half(), _rand(1, 5, 2, 64).half()
    with pytest.raises(ValueError, match="one batch, head count and head dim"):
        attend_chunks([Partial()], [q], [(k, k), (k[:, :, :1], k[:, :, :1])], kernel=kernel)
    strided = Partial(torch.zeros(1, 2, 6, 64).transpose(1, 2), torch.zeros(1, 2, 6))  # [B, Lq, H, D], not contiguous
    with pytest.raises(ValueError, match="state must be contiguous"):
        attend_chunks([strided], [q], [(k, k)], kernel=kernel)
    wrong = Partial(torch.zeros(1, 6, 2, 64), torch.zeros(1, 6, 2))  # lse [B, Lq, H] instead of [B, H, Lq]
    with pytest.raises(ValueError, match=r"lse \[1, 2, 6\]"):
        attend_chunks([wrong], [q], [(k, k)], kernel=kernel)


def test_the_fused_kernels_check_the_layouts_they_address() -> None:
    """chunk_tables, which both fused kernels (Gluon, Triton) launch from: no chunk without rows (the Gluon kernel
    would wait for a key tile forever), and state, output and lse exactly as the kernels index them."""
    from streamfusion_diffusers.kernels.chunk_tables import chunk_tables

    q, k = _rand(1, 6, 2, 64).half(), _rand(1, 5, 2, 64).half()
    lse, state = torch.zeros(1, 2, 6), torch.zeros(1, 6, 2, 64)

    def tables(kv=((k, k),), states=((None, lse),), outs=(q.new_empty(q.shape),), finalize=True) -> None:
        chunk_tables([q], list(kv), list(states), list(outs), finalize, 128, 128)

    tables()  # as the kernels want it
    with pytest.raises(ValueError, match="L >= 1"):
        tables(kv=[(k[:, :0], k[:, :0])])
    with pytest.raises(ValueError, match="at least one query and one key/value chunk"):
        tables(kv=[])
    with pytest.raises(ValueError, match="writes lse as a contiguous torch.float32"):
        tables(states=[(None, torch.zeros(1, 6, 2).transpose(1, 2))])
    with pytest.raises(ValueError, match="writes out as a contiguous torch.float16"):
        tables(outs=[torch.zeros(1, 6, 2, 64)])  # finalized: the query dtype
    with pytest.raises(ValueError, match="writes out as a contiguous torch.float32"):
        tables(outs=[q.new_empty(q.shape)], finalize=False)  # a running state: float32
    with pytest.raises(ValueError, match="writes state as a contiguous"):
        tables(states=[(torch.zeros(1, 2, 6, 64).transpose(1, 2), lse)], outs=[state], finalize=False)


def test_pinned_choices_are_made_by_rule_and_never_timed() -> None:
    """--deterministic: the kernel choice runs no candidate to time it, in a layer call or out of one."""
    from streamfusion_diffusers.kernels import dispatch
    from streamfusion_diffusers.kernels.state import KernelState, owned_by

    def untimed(*_: object) -> None:
        raise AssertionError("a pinned choice timed a candidate")

    candidates = {"sdpa": (untimed, untimed), "fused": (untimed, untimed)}
    dispatch.pin()
    try:
        with owned_by(KernelState()):
            assert dispatch.choose(("shape",), lambda: candidates) == "fused"
            assert dispatch.choose(("shape",), lambda: {"sdpa": candidates["sdpa"]}) == "sdpa"
    finally:
        dispatch.pin(False)
