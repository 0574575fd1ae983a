"""GPU tests of the attention kernels against float32 attention, on fresh random inputs every run (chunk
lengths drawn at random, so almost never multiples of a tile)."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from streamfusion_diffusers.core.exactness import reference_attention, relative_error, threshold
from streamfusion_diffusers.kernels import dispatch
from streamfusion_diffusers.kernels.attend import attend_chunks, attention_with_lse
from streamfusion_diffusers.kernels.merge import merge_into, merge_into_reference
from streamfusion_diffusers.kernels.partial import Partial
from streamfusion_diffusers.kernels.reference import attention_with_lse_reference
from streamfusion_diffusers.kernels.sdpa import BACKENDS, attention_no_lse, attention_sdpa, attention_with_lse_sdpa
from streamfusion_diffusers.kernels.state import KernelState, current, owned_by

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return relative_error(got, want)


def _lengths(n: int, low: int, high: int) -> list[int]:
    return torch.randint(low, high, (n,)).tolist()


@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient"])
def test_sdpa_backend_lse(backend: str) -> None:
    lq, lk = _lengths(2, 200, 1200)
    q, k, v = (torch.randn(2, n, 4, 128, device="cuda", dtype=torch.bfloat16) for n in (lq, lk, lk))
    out, lse = attention_with_lse_sdpa(q, k, v, 0.1, backends=[backend])
    ref_lse = attention_with_lse_reference(q, k, v, 0.1)[1]
    assert lse.shape == (2, 4, lq) and lse.dtype == torch.float32
    assert _rel(out, reference_attention(q, k, v, 0.1)) <= threshold(q.dtype)
    assert (lse - ref_lse).abs().max() < 2e-2  # a log: its absolute error is the sum's relative one


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# The fused kernels: the device's own (fused.kernel_for), and the portable Triton one forced, with and without TMA.
FUSED = ["fused", "fused-triton", "fused-pointers"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("kernel", [*FUSED, "sdpa", "auto"])
def test_chunks_match_float32_attention(dtype: torch.dtype, dim: int, kernel: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Uneven head-sliced query chunks over three calls (fresh state, loaded state, finalize)."""
    from streamfusion_diffusers.kernels import fused, triton_attention

    if kernel in ("fused-triton", "fused-pointers"):  # as if this device had no Gluon kernel: Triton's settles
        monkeypatch.setattr(fused, "_launched", {})
        monkeypatch.setattr(fused, "kernel_for", lambda device, variant=None: triton_attention.multi_chunk_attention)
    if kernel == "fused-pointers":  # the Triton variant without TMA
        cfg = dataclasses.replace(triton_attention.DEFAULT_CONFIGS[dim], use_tma=False, num_stages=2)
        monkeypatch.setitem(triton_attention.DEFAULT_CONFIGS, dim, cfg)
    kernel = "fused" if kernel in FUSED else kernel
    dispatch.clear()
    b, h = 2, 6
    q_lens, kv_lens = _lengths(3, 1, 700), _lengths(5, 1, 900)
    q = torch.randn(b, sum(q_lens), 2 * h, dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, sum(kv_lens), 2 * h, dim, device="cuda", dtype=dtype) for _ in range(2))
    heads = slice(h // 2, h // 2 + h)
    q_chunks = list(q[:, :, heads].split(q_lens, dim=1))
    kv_chunks = list(zip(k[:, :, heads].split(kv_lens, dim=1), v[:, :, heads].split(kv_lens, dim=1)))
    partials = [Partial() for _ in q_chunks]
    attend_chunks(partials, q_chunks, kv_chunks[:1], kernel=kernel)
    attend_chunks(partials[:2], q_chunks[:2], kv_chunks[1:4], kernel=kernel)  # the third Q chunk skips these
    attend_chunks(partials, q_chunks, kv_chunks[4:], kernel=kernel, finalize=True)
    for i, (p, qc) in enumerate(zip(partials, q_chunks)):
        kv = kv_chunks if i < 2 else [kv_chunks[0], kv_chunks[4]]
        kc, vc = torch.cat([c[0] for c in kv], 1), torch.cat([c[1] for c in kv], 1)
        ref_lse = attention_with_lse_reference(qc, kc, vc, dim ** -0.5)[1]
        assert p.final and p.out.dtype == dtype
        assert _rel(p.result(dtype), reference_attention(qc, kc, vc)) <= threshold(dtype)
        assert (p.lse - ref_lse).abs().max() < 1e-2  # a log: its absolute error is the sum's relative one


def _fused_kernel(name: str) -> Callable[..., None]:
    """A fused kernel module's launch function; the Gluon one only where it runs (Hopper)."""
    if name == "gluon" and not _hopper():
        pytest.skip("the Gluon kernel runs on Hopper (compute capability 9.0)")
    from streamfusion_diffusers.kernels import gluon_attention, triton_attention

    return {"gluon": gluon_attention, "triton": triton_attention}[name].multi_chunk_attention


def test_hopper_takes_the_gluon_kernel() -> None:
    from streamfusion_diffusers.kernels import fused, gluon_attention, triton_attention

    want = gluon_attention if _hopper() else triton_attention
    q = torch.randn(1, 100, 2, 128, device="cuda", dtype=torch.bfloat16)
    attention_with_lse(q, q, q, kernel="fused")  # this variant's first fused launch settles its kernel
    variant = fused.Variant(torch.bfloat16, 128, load_state=False, finalize=True)
    assert fused.kernel_for(q.device, variant) is want.multi_chunk_attention
    assert (q.device, variant) in fused._launched


# Empty keys or queries through the fused path, in a child process so that a hang (the Gluon kernel waiting for a
# key tile that never comes) fails the test at its timeout instead of stalling the suite.
EMPTY_INPUTS = """
import torch
from streamfusion_diffusers.kernels import fused
from streamfusion_diffusers.kernels.attend import attention_with_lse
q = torch.randn(1, 256, 2, 128, device="cuda", dtype=torch.bfloat16)
for name, (qq, kk) in {"keys": (q, q[:, :0]), "queries": (q[:, :0], q)}.items():
    lse = torch.empty(1, 2, qq.shape[1], device="cuda")
    calls = {"attention_with_lse": lambda: attention_with_lse(qq, kk, kk, kernel="fused"),  # the kernels' entry
             "fused launch": lambda: fused.multi_chunk_attention(  # below it: the device's kernel (Gluon on Hopper)
                 [qq], [(kk, kk)], [(None, lse)], [torch.empty_like(qq)], 0.1, True)}
    for call, run in calls.items():
        try:
            run()
        except ValueError as err:
            print(f"empty {name}, {call}: refused: {err}")
        else:
            raise SystemExit(f"empty {name}, {call}: no error")
torch.cuda.synchronize()
print("done")
"""


def test_the_fused_path_refuses_empty_inputs_rather_than_hang() -> None:
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    try:
        run = subprocess.run([sys.executable, "-c", EMPTY_INPUTS], capture_output=True, text=True, timeout=180,
                             env=env, cwd=root)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the fused path hung on empty inputs (killed after {err.timeout} s)")
    assert run.returncode == 0 and run.stdout.count("refused") == 4 and "done" in run.stdout, \
        run.stdout + run.stderr[-3000:]
    assert "no keys" in run.stdout and "no queries" in run.stdout and "L >= 1" in run.stdout, run.stdout


@pytest.mark.parametrize("name", ["triton", "gluon"])
def test_fused_kernel_writes_every_element(name: str) -> None:
    multi_chunk_attention = _fused_kernel(name)
    q_lens, kv_lens = _lengths(2, 1, 500), _lengths(2, 1, 500)
    qs = [torch.randn(1, n, 3, 128, device="cuda", dtype=torch.bfloat16) for n in q_lens]
    kvs = [tuple(torch.randn(1, n, 3, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)) for n in kv_lens]
    outs = [torch.full(x.shape, float("nan"), device="cuda", dtype=torch.bfloat16) for x in qs]
    lses = [torch.full((1, 3, n), float("nan"), device="cuda") for n in q_lens]
    multi_chunk_attention(qs, kvs, [(None, lse) for lse in lses], outs, 0.1, finalize=True)
    assert all(torch.isfinite(o).all() and torch.isfinite(lse).all() for o, lse in zip(outs, lses))
    k, v = (torch.cat([kv[i] for kv in kvs], dim=1) for i in (0, 1))
    assert all(_rel(o, reference_attention(q, k, v, 0.1)) <= threshold(torch.bfloat16) for o, q in zip(outs, qs))


@pytest.mark.parametrize("name", ["triton", "gluon"])
def test_fused_kernel_replays_in_a_cuda_graph(name: str) -> None:
    """A captured fused launch replays bit-identical to eager, also after the host memory it was built from is
    reused (its chunk tables come from pinned memory kept by the state it was captured under, a context's)."""
    multi_chunk_attention = _fused_kernel(name)
    q_lens, kv_lens = _lengths(2, 64, 700), _lengths(3, 64, 700)
    qs = [torch.randn(1, n, 4, 64, device="cuda", dtype=torch.bfloat16) for n in q_lens]
    kvs = [tuple(torch.randn(1, n, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2)) for n in kv_lens]
    lses = [torch.empty((1, 4, n), device="cuda") for n in q_lens]
    outs = [torch.empty_like(x) for x in qs]

    def run() -> None:
        multi_chunk_attention(qs, kvs, [(None, lse) for lse in lses], outs, 0.125, finalize=True)

    run()
    torch.cuda.synchronize()
    want = [o.clone() for o in outs]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up (compilation) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph, state = torch.cuda.CUDAGraph(), KernelState()
    with owned_by(state), torch.cuda.graph(graph):
        run()
    assert len(state.tables) == 1 and not current().tables  # the owner keeps the table, not the process
    for o in outs:
        o.fill_(float("nan"))
    _ = [torch.tensor([[-1] * 9] * 8).pin_memory() for _ in range(64)]  # reuse freed pinned host blocks
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(o, w) for o, w in zip(outs, want))


def test_one_pass_merge_matches_reference() -> None:
    b, lq, h, d = 2, int(_lengths(1, 100, 3000)[0]), 5, 128
    out, lse = torch.randn(b, lq, h, d, device="cuda"), torch.randn(b, h, lq, device="cuda")
    new_out = torch.randn(b, h, lq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    new_lse = torch.randn(b, h, lq + 31, device="cuda")[..., :lq]
    want_out, want_lse = out.clone(), lse.clone()
    merge_into_reference(want_out, want_lse, new_out, new_lse)
    merge_into(out, lse, new_out, new_lse)
    assert _rel(out, want_out) < 1e-6 and (lse - want_lse).abs().max() < 1e-5


def test_auto_caches_one_choice_per_signature() -> None:
    dispatch.clear()
    q, k, v = (torch.randn(1, 5120, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))  # >= the floor
    for _ in range(2):
        attend_chunks([Partial()], [q], [(k, v)], kernel="auto", finalize=True)
    assert list(current().local.values()) in (["sdpa"], ["fused"])  # the standalone calls' state


def test_auto_takes_sdpa_untimed_below_the_fused_floor() -> None:
    """Queries over every key at once, fewer than FUSED_MIN_WORK queries x keys: sdpa, no candidate timed (no fused
    compile in a job's first step); the same work as several query chunks is still timed (the fused kernel saves
    launches), and so is a pass that merges into a state (a ring's)."""
    from streamfusion_diffusers.kernels.choice import FUSED_MIN_WORK

    dispatch.clear()
    n = int(FUSED_MIN_WORK ** 0.5) - 64
    q, k, v = (torch.randn(1, n, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    attend_chunks([Partial()], [q], [(k, v)], kernel="auto", finalize=True)
    assert not current().local and not current().times
    attend_chunks([Partial(), Partial()], [q[:, : n // 2], q[:, n // 2:]], [(k, v)], kernel="auto", finalize=True)
    assert list(current().local.values()) in (["sdpa"], ["fused"])
    attend_chunks([Partial()], [q], [(k, v)], kernel="auto", finalize=False)  # a ring's first pass: a state follows
    assert len(current().local) == 2


def test_attention_without_lse_runs_the_fastest_backend() -> None:
    """The whole-keys call (P = 1, or Ulysses after its all-to-all) times the SDPA backends once per shape and keeps
    the fastest: its output is that backend's, bit for bit, and exact to the float32 reference."""
    q, k, v = (torch.randn(1, n, 8, 128, device="cuda", dtype=torch.bfloat16) for n in (3000, 2000, 2000))
    state = KernelState()
    with owned_by(state):
        out = attention_sdpa(q, k, v, 0.1)
        again = attention_sdpa(q, k, v, 0.1)
    (pick,) = state.no_lse.values()
    assert pick in BACKENDS and torch.equal(out, attention_no_lse(pick, q, k, v, 0.1)) and torch.equal(out, again)
    assert _rel(out, reference_attention(q, k, v, 0.1)) <= threshold(q.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rotary_qk_is_diffusers_bit_for_bit(dtype: torch.dtype) -> None:
    """Flux's rotary tables (its position embedding of text and image ids) and random ones, at a rank's share of
    flux-dev 1024 and at an odd row count: the one Triton pass gives diffusers' apply_rotary_emb bit for bit,
    eagerly and replayed from a CUDA graph."""
    pytest.importorskip("triton")
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    from streamfusion_diffusers.kernels import rotary
    from streamfusion_diffusers.kernels.rotary import rotary_qk

    rows = int(_lengths(1, 900, 1400)[0])
    ids = torch.cat([torch.zeros(128, 3), torch.randint(0, 64, (rows, 3)).float()]).cuda()
    flux = FluxPosEmbed(theta=10000, axes_dim=[16, 56, 56])(ids)
    random = tuple(torch.randn(128 + rows, 128, device="cuda") for _ in range(2))
    for freqs in (flux, random):
        q, k = (torch.randn(1, 128 + rows, 24, 128, device="cuda", dtype=dtype) for _ in range(2))
        assert rotary._fits(q, k, *freqs)
        for x, got in zip((q, k), rotary_qk(q, k, freqs)):
            assert torch.equal(got, apply_rotary_emb(x, freqs, sequence_dim=1))
        want = rotary_qk(q, k, freqs)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = rotary_qk(q, k, freqs)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, w) for o, w in zip(out, want))


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize(("kernel", "tol"), [("int8", 2.5e-2), ("fp8", 5e-2)])
def test_quantized_attention_on_the_gpu(kernel: str, tol: float, dim: int) -> None:
    """The 8-bit kernels (fp8: P V on float8 tensor cores too) in bfloat16 (which the interpreter cannot read), at
    fresh uneven lengths: the output and the log-sum-exp against float32 attention, fp8's log-sum-exp int8's (P is
    quantized after the softmax's sums), two key chunks merged as a ring pass merges them."""
    from streamfusion_diffusers.kernels.choice import quantized_supported

    if not quantized_supported(kernel):
        pytest.skip(f"no {kernel} tensor cores on this GPU")
    lq, lk, cut = _lengths(3, 300, 2000)
    cut = cut % (lk - 1) + 1
    q, k, v = (torch.randn(1, n, 8, dim, device="cuda", dtype=torch.bfloat16) for n in (lq, lk, lk))
    k = k + 2  # keys away from a zero mean: the smoothing's case
    want, want_lse = attention_with_lse_reference(q.float(), k.float(), v.float(), dim ** -0.5)
    out, lse = attention_with_lse(q, k, v, kernel=kernel)
    assert out.dtype == torch.bfloat16 and _rel(out, want) <= tol
    assert (lse - want_lse).abs().max() <= 2e-2
    if kernel == "fp8":
        assert (lse - attention_with_lse(q, k, v, kernel="int8")[1]).abs().max() <= 1e-4
    partial = Partial()
    attend_chunks([partial], [q], [(k[:, :cut], v[:, :cut]), (k[:, cut:], v[:, cut:])], kernel=kernel, finalize=True)
    assert _rel(partial.result(torch.float32), want) <= tol
