"""Dev: the Gluon Hopper kernel's correctness and speed beside cuDNN+LSE and the Triton fused kernel."""
import os, statistics, sys, time, traceback
import torch
sys.path.insert(0, os.getcwd())
from streamfusion_diffusers.kernels import gluon_attention as ga
from streamfusion_diffusers.kernels import triton_attention as ta

torch.manual_seed(0)
dev = "cuda"


def ref(qs, kvs, scale):
    k = torch.cat([k for k, _ in kvs], 1).double()
    v = torch.cat([v for _, v in kvs], 1).double()
    outs = []
    for q in qs:
        s = torch.einsum("blhd,bkhd->bhlk", q.double(), k) * scale
        lse = torch.logsumexp(s, -1)
        outs.append((torch.einsum("bhlk,bkhd->blhd", s.softmax(-1), v), lse))
    return outs


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check(variant, dim=128, dtype=torch.bfloat16, split=False):
    B, H = 2, 3
    qs = [torch.randn(B, n, H, dim, device=dev, dtype=dtype) for n in (1000, 77)]
    big = torch.randn(B, 900, H, 2 * dim, device=dev, dtype=dtype)  # strided views: k, v halves
    kvs = [(big[:, :513, :, :dim], big[:, :513, :, dim:]), (big[:, 513:641, :, :dim], big[:, 513:641, :, dim:]),
           (big[:, 641:642, :, :dim], big[:, 641:642, :, dim:])]
    scale = dim ** -0.5
    want = ref(qs, kvs, scale)
    lses = [torch.empty(B, H, q.shape[1], device=dev) for q in qs]
    outs = [torch.empty_like(q) for q in qs]
    if split:
        st = [torch.empty(B, q.shape[1], H, dim, device=dev) for q in qs]
        ga.multi_chunk_attention(qs, kvs[:1], [(None, l) for l in lses], st, scale, False, **variant)
        ga.multi_chunk_attention(qs, kvs[1:], list(zip(st, lses)), outs, scale, True, **variant)
    else:
        ga.multi_chunk_attention(qs, kvs, [(None, l) for l in lses], outs, scale, True, **variant)
    torch.cuda.synchronize()
    return max(max(rel(o, w), rel(l, wl)) for o, l, (w, wl) in zip(outs, lses, want))


def graph_ms(fn, calls=20, reps=10):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); g.replay(); e.record(); e.synchronize()
        out.append(s.elapsed_time(e) / calls)
    return out


V128 = {"pp st2": dict(pingpong=True, stages=2), "nopp st2": dict(pingpong=False, stages=2)}
V64 = {"pp st2": dict(pingpong=True, stages=2), "nopp st2": dict(pingpong=False, stages=2),
       "pp st3": dict(pingpong=True, stages=3), "pp bn64 st2": dict(pingpong=True, stages=2, block_n=64)}
print(torch.cuda.get_device_name(), flush=True)
for name, var in V64.items():
    for kw in (dict(dim=64), dict(dim=64, split=True)):
        try:
            print(f"check {name} {kw}: rel err {check(var, **kw):.2e}", flush=True)
        except Exception as err:
            print(f"check {name} {kw}: FAILED {type(err).__name__}: {str(err)[:300]}", flush=True)

SHARES = [("flux1024/P8", 576, 4608, 24, 128), ("flux2048/P2", 8448, 16896, 24, 128),
          ("cogvideox49-480x720/P2", 8888, 17776, 48, 64), ("flux4096/P2", 33024, 66048, 24, 128)]
for share, lq, lk, h, d in SHARES:
    q = torch.randn(1, lq, h, d, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(1, lk, h, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    scale = d ** -0.5
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    out = torch.empty_like(q)
    lse = torch.empty(1, h, lq, device=dev)
    st = torch.empty(1, lq, h, d, device=dev)
    half = lk // 2
    k1, v1, k2, v2 = k[:, :half], v[:, :half], k[:, half:], v[:, half:]
    cols = {"cudnn+lse": lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(qt, kt, vt, None, True, 0.0, False, False, scale=scale),
            "triton fused": lambda: ta.multi_chunk_attention([q], [(k, v)], [(None, lse)], [out], scale, True)}
    variants = V128 if d == 128 else V64
    for name, var in variants.items():
        cols["gluon " + name] = lambda var=var: ga.multi_chunk_attention([q], [(k, v)], [(None, lse)], [out], scale, True, **var)
    if lq > 1000:
        cols["triton 4 kv chunks"] = lambda: ta.multi_chunk_attention([q], [(k[:, i * lk // 4:(i + 1) * lk // 4], v[:, i * lk // 4:(i + 1) * lk // 4]) for i in range(4)], [(None, lse)], [out], scale, True)
        cols["gluon 4 kv chunks"] = lambda: ga.multi_chunk_attention([q], [(k[:, i * lk // 4:(i + 1) * lk // 4], v[:, i * lk // 4:(i + 1) * lk // 4]) for i in range(4)], [(None, lse)], [out], scale, True)
        def two_calls(mod):
            mod.multi_chunk_attention([q], [(k1, v1)], [(None, lse)], [st], scale, False)
            mod.multi_chunk_attention([q], [(k2, v2)], [(st, lse)], [out], scale, True)
        cols["triton 2 calls (state)"] = lambda: two_calls(ta)
        cols["gluon 2 calls (state)"] = lambda: two_calls(ga)
    calls = 40 if lq < 20000 else 5
    res = {}
    for col, fn in cols.items():
        try:
            t = graph_ms(fn, calls)
            res[col] = statistics.median(t)
            extra = ""
            if col != "cudnn+lse":
                fn(); torch.cuda.synchronize()
                o_ref = torch.ops.aten._scaled_dot_product_cudnn_attention(qt, kt, vt, None, True, 0.0, False, False, scale=scale)[0].transpose(1, 2)
                extra = f" err {rel(out, o_ref):.2e}"
            print(f"{share} {col}: min {min(t):.3f} med {res[col]:.3f} max {max(t):.3f} ms  cudnn/this {res['cudnn+lse'] / res[col]:.3f}{extra}", flush=True)
        except Exception as err:
            print(f"{share} {col}: FAILED {type(err).__name__}: {str(err)[:300]}", flush=True)
