"""Issue 11 in one job on 1 x P GPUs: what the fixed cost of a layer and of a step comes to, and what CUDA graphs,
torch.compile take off it, beside xDiT's USP, diffusers' context parallelism and the bound.

    python3 -m streamfusion_diffusers launch --nproc-per-node 2 --model flux-dev --resolution 2048 \
        benchmarks/fixedcost_bench.py --out "$OUT/fixedcost"

(a) One Flux attention layer at 1024 and 2048 px (`streamfusion bench` layer level: every layout of ours eager
    and replayed from a CUDA graph, xDiT's USP, the no-communication bound; repetitions interleaved).
(b) One whole Flux.1-dev step at 2048 px (real config, random weights, bf16; `streamfusion bench` step level):
    the bound (eager, CUDA graph, compiled), ours eager / +cuda-graph / +compile at the step layouts,
    diffusers' context parallelism.
(c) Per layer size, Ulysses U = P: Q, K, V scattered in one all-to-all and O gathered, with the layout copies
    before issue 11 (two each way) and now (one; none for O at batch 1), checked equal, timed interleaved.
Every row is checked against the unparallelized model or exact attention, as `streamfusion bench` does. Prints
the bench table and a ratio table with the issue's bars (rank 0); writes table.md, results.json, plot.png and
ratios.json, qkv_layout.json under --out.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from streamfusion_diffusers import ParallelConfig, init_parallel
from streamfusion_diffusers.attention.ulysses import _peer_lens, gather_heads, scatter_heads
from streamfusion_diffusers.attention.volume import peer_bytes
from streamfusion_diffusers.bench import report, xdit
from streamfusion_diffusers.bench.command import _cases as bench_cases, _ok, run_tasks
from streamfusion_diffusers.bench.layer import Case, Setup, bench_layer, device_of_job, padded_length
from streamfusion_diffusers.bench.model import ModelSetup, bench_model
from streamfusion_diffusers.bench.variants import VARIANTS, with_variants
from streamfusion_diffusers.choice.workloads import parse_workload, transformer_config
from streamfusion_diffusers.runtime.run import job_shape, run_job
from streamfusion_diffusers.commands.timing import interleaved_ms
from streamfusion_diffusers.core.sequence import split_sizes

OURS = ("ulysses", "usp", "tas", "torus")
# the bars: (level, workload px, what, limit); "bound": ours / bound <= limit; baseline: ours / it <= limit
BARS = [("layer", 1024, "xdit-usp", 0.80), ("layer", 2048, "bound", 1.15), ("layer", 2048, "xdit-usp", 0.90),
        ("step", 2048, "bound", 1.04), ("step", 2048, "diffusers-cp", 1 / 1.15)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "outputs"), "fixedcost"))
    p.add_argument("--backend", default="torch", help="our transport: torch (NCCL) or nvshmem")
    p.add_argument("--layer-sizes", default="1024,2048", help="Flux sides of the layer level (px)")
    p.add_argument("--step-size", type=int, default=2048, help="Flux side of the step level (px); 0 skips it")
    p.add_argument("--step-layouts", default=None,
                   help="ours at step level, METHOD:UxRy[Tz] comma-separated (default: usp U1R{P} and ulysses "
                        "U{P}R1, the measured best and the all-to-all one)")
    p.add_argument("--step-variants", default=",".join(VARIANTS))
    p.add_argument("--cp-layouts", default=None, help="diffusers-cp layouts (default U{P}R1, its measured best)")
    p.add_argument("--no-xdit", action="store_true", help="leave xDiT's USP out (yunchang not installed)")
    p.add_argument("--layer-iters", type=int, default=30)
    p.add_argument("--step-iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one case may take")
    p.add_argument("--cpu", action="store_true", help="a smoke run of this script: 2 gloo processes, tiny Flux, "
                   "float32, no CUDA graphs, no xDiT, no diffusers-cp")
    return p.parse_args()


def _pick(method: str, layouts: str, p: int, heads: int, dtype: torch.dtype) -> list[Case]:
    return bench_cases(method, layouts, 1, p, heads, dtype != torch.float32, dtype)


def tasks(args: argparse.Namespace, p: int) -> list:
    dtype = torch.float32 if args.cpu else torch.bfloat16
    graph = () if args.cpu else ("cuda-graph",)
    out = []
    for side in (int(s) for s in args.layer_sizes.split(",") if s):
        w = parse_workload(f"flux-dev:{side}")
        setup = Setup(w, 1, p, args.backend, None, dtype, args.layer_iters, 5, 0, args.timeout)
        cases = [Case("bound")] + [c for m in OURS for c in _pick(m, "best", p, w.heads, dtype)]
        cases += [] if args.no_xdit or args.cpu else _pick("xdit-usp", "best", p, w.heads, dtype)
        out.append((bench_layer, setup, with_variants(cases, ("eager", *graph), ("layer",))))
        out.append((qkv_layout, setup, []))
    if args.step_size:
        w = parse_workload(f"flux-dev:{args.step_size}")
        config = transformer_config(w, "tiny" if args.cpu else "real")
        setup = Setup(w, 1, p, args.backend, None, dtype, args.step_iters, args.warmup, 0, args.timeout)
        ours = [c for spec in (args.step_layouts or f"usp:U1R{p},ulysses:U{p}R1").split(",")
                for c in _pick(spec.split(":")[0], spec.split(":")[1], p, w.heads, dtype)]
        cp = [] if args.cpu else _pick("diffusers-cp", args.cp_layouts or f"U{p}R1", p, w.heads, dtype)
        wanted = (v.strip() for v in args.step_variants.split(","))
        variants = tuple(v for v in wanted if v and (v in graph or v != "cuda-graph"))
        out.append((bench_model, ModelSetup(setup, config, ("step",)),
                    with_variants([Case("bound")] + ours, variants, ("step",)) + cp))
    return out


def _flat_all_to_all(recv: Tensor, send: Tensor, recv_splits: list[int], send_splits: list[int], mesh,
                     transport) -> None:
    """The flat all-to-all of before issue 11: one piece per peer, split off a flat buffer."""
    pieces = [[p] for p in send.split(send_splits)], [[p] for p in recv.split(recv_splits)]
    transport.all_to_all(*pieces, mesh.ulysses_intra).wait()


def _scatter_before(xs: list[Tensor], mesh, transport, lens: list[int]) -> list[Tensor]:
    """`scatter_heads` as it was before issue 11 (kept here to compare in one job): two copies each way."""
    n_t, n_u = mesh.layout.torus, mesh.layout.ulysses_intra
    b, length, heads, d = xs[0].shape
    h = heads // (n_t * n_u)
    send = torch.stack([x.view(b, length, n_t, n_u, h, d) for x in xs]).permute(4, 0, 1, 2, 3, 5, 6).contiguous()
    peer = _peer_lens(mesh, lens)
    per_token = len(xs) * b * n_t * h * d
    recv = send.new_empty(per_token * sum(peer))
    _flat_all_to_all(recv, send.view(-1), [per_token * n for n in peer], [per_token * length] * n_u, mesh,
                     transport)
    pieces = [x.view(len(xs), b, n, n_t, h, d) for x, n in zip(recv.split([per_token * n for n in peer]), peer)]
    return list(torch.cat(pieces, dim=2).permute(0, 3, 1, 2, 4, 5).contiguous().unbind(0))


def _gather_before(out: list[Tensor], mesh, transport, lens: list[int]) -> Tensor:
    """`gather_heads` as it was before issue 11: the output copied into a send buffer."""
    n_t, n_u = mesh.layout.torus, mesh.layout.ulysses_intra
    b, _, h, d = out[0].shape
    peer = _peer_lens(mesh, lens)
    length = peer[mesh.u]
    stacked = out[0].unsqueeze(2) if n_t == 1 else torch.stack(list(out), dim=2)
    send = torch.cat([x.reshape(-1) for x in stacked.split(peer, dim=1)])
    per_token = b * n_t * h * d
    recv = send.new_empty(n_u * per_token * length)
    _flat_all_to_all(recv, send, [per_token * length] * n_u, [per_token * n for n in peer], mesh, transport)
    return recv.view(n_u, b, length, n_t, h, d).permute(1, 2, 3, 0, 4, 5).reshape(b, length, n_t * n_u * h, d)


def qkv_layout(setup: Setup, _cases: list) -> list[dict]:
    """(c) Ulysses U = P: Q, K, V out and O back, before (two layout copies each way) and now (one; O none),
    checked equal and timed interleaved, transfers included."""
    w, p = setup.workload, dist.get_world_size()
    ctx = init_parallel(ParallelConfig(machines=1, gpus_per_machine=p, method="ulysses", backend=setup.backend))
    mesh, transport, device = ctx.mesh(w.heads), ctx.transport, device_of_job()
    lens = split_sizes(padded_length(w, p), p)
    g = torch.Generator(device=device).manual_seed(setup.seed)
    xs = [torch.randn(1, lens[ctx.rank], w.heads, w.head_dim, generator=g, device=device, dtype=setup.dtype)
          for _ in range(3)]
    volume = peer_bytes(mesh.layout, lens, 1, w.heads, w.head_dim, 0, xs[0].element_size())

    def layer(fn):
        def call():
            transport.begin_layer(volume)
            result = fn()
            transport.end_layer()
            return result
        return call

    calls = {"scatter Q, K, V before": layer(lambda: _scatter_before(xs, mesh, transport, lens)),
             "scatter Q, K, V now": layer(lambda: scatter_heads(xs, mesh, transport, lens)),
             "gather O before": layer(lambda: _gather_before(parts, mesh, transport, lens)),
             "gather O now": layer(lambda: gather_heads(parts, mesh, transport, lens))}
    parts = [x.contiguous() for x in calls["scatter Q, K, V now"]()[0].unbind(0)]  # O's head parts: Q's layout
    same = all(torch.equal(a, b) for a, b in zip(calls["scatter Q, K, V before"](), calls["scatter Q, K, V now"]()))
    same = same and torch.equal(calls["gather O before"](), calls["gather O now"]())
    stats = interleaved_ms(list(calls.values()), setup.iters, setup.warmup, device, setup.timeout_s)
    return [dict(workload=w.name, level="qkv-layout", what=name, **s.row(), equal=same)
            for name, s in zip(calls, stats)]


def ratios(rows: list[dict]) -> list[dict]:
    """Per workload and level: the bound, the best baseline, ours best per variant, and the issue's bars."""
    lines = []
    for key in dict.fromkeys((r["workload"], r["level"]) for r in rows):
        mine = [r for r in rows if (r["workload"], r["level"]) == key]
        bound = next(r["ms"] for r in mine if r["method"] == "bound")
        base_name = report.BASELINE[key[1]]
        base = min((r["ms"] for r in mine if r["method"] == base_name), default=None)
        for variant in ["eager"] + [v for v in VARIANTS if v != "eager"]:
            rows_v = [r for r in mine if r["method"].split("+")[0] in OURS
                      and (r["method"].partition("+")[2] or "eager") == variant]
            if not rows_v:
                continue
            best = min(rows_v, key=lambda r: r["ms"])
            own = next((r["ms"] for r in mine if r["method"] == f"bound+{variant}"), bound)  # equally helped bound
            side = int(key[0].split()[1].split("x")[0])
            bars = []
            for level, px, what, limit in BARS:
                ref = bound if what == "bound" else base
                if (level, px) == (key[1], side) and ref:
                    ratio = best["ms"] / ref
                    bars.append(f"{'PASS' if ratio <= limit else 'FAIL'} /{what} {ratio:.2f} <= {limit:.2f}")
            lines.append(dict(workload=key[0], level=key[1], variant=variant, layout=best["layout"],
                              ms=best["ms"], bound_ms=bound, vs_bound=best["ms"] / bound, vs_own_bound=best["ms"] / own,
                              baseline=base_name, baseline_ms=base, vs_baseline=best["ms"] / base if base else None,
                              bars="; ".join(bars)))
    return lines


def ratio_table(lines: list[dict]) -> str:
    out = ["| workload | level | ours variant | best layout | ms | x bound | x bound same variant | baseline ms | "
           "x baseline | bars |", "|---|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in lines:
        base = f"{r['baseline']} {r['baseline_ms']:.3f}" if r["baseline_ms"] else "-"
        vs = f"{r['vs_baseline']:.2f}" if r["vs_baseline"] else "-"
        out.append(f"| {r['workload']} | {r['level']} | {r['variant']} | {r['layout']} | {r['ms']:.3f} | "
                   f"{r['vs_bound']:.2f} | {r['vs_own_bound']:.2f} | {base} | {vs} | {r['bars']} |")
    return "\n".join(out)


def main() -> int:
    args = parse_args()
    if not (args.no_xdit or args.cpu or xdit.available()):
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"fixedcost_bench: xDiT's USP left out ({xdit.INSTALL_HINT})")
        args.no_xdit = True
    world, gpu = job_shape(2, args.cpu)
    if not gpu and not args.cpu:
        raise SystemExit("fixedcost_bench needs GPUs: run it under streamfusion launch / torchrun on a GPU host "
                         "(or --cpu for a smoke run)")
    rows = run_job(run_tasks, world, tasks(args, world), gpu=gpu, timeout_s=1800)[0]
    if int(os.environ.get("RANK", 0)) != 0:
        return 0
    copies = [r for r in rows if r["level"] == "qkv-layout"]
    rows = [r for r in rows if r["level"] != "qkv-layout"]
    for row in rows:
        row["ok"] = _ok(row, torch.bfloat16 if gpu else torch.float32)
    lines = ratios(rows)
    device = torch.cuda.get_device_name() if gpu else "CPU processes"
    title = (f"Issue 11: fixed costs, 1 x {world} {device}, {'bf16' if gpu else 'float32'}, {args.backend}; layer: "
             f"min / median / max of {args.layer_iters} interleaved; step: {args.step_iters} after {args.warmup} "
             f"warm-up")
    out = Path(args.out)
    report.write(rows, {"world": world, "device": device, "args": vars(args)}, out, title)
    (out / "ratios.json").write_text(json.dumps(lines, indent=2))
    (out / "qkv_layout.json").write_text(json.dumps(copies, indent=2))
    print(report.markdown(rows, f"## {title}"))
    print(ratio_table(lines))
    print("\n| workload | Ulysses U=P, transfers included | ms | min - max | outputs equal |\n|---|---|---:|---:|---|")
    for r in copies:
        print(f"| {r['workload']} | {r['what']} | {r['ms']:.3f} | {r['min_ms']:.3f} - {r['max_ms']:.3f} | "
              f"{r['equal']} |")
    bad = [r for r in rows if not r["ok"]]
    for r in bad:
        print(f"MISMATCH: {r['workload']} {r['level']} {r['layout']} abs {r['max_abs_err']} rel {r['rel_err']}")
    bad += [r for r in copies if not r["equal"]]
    for r in copies if not all(r["equal"] for r in copies) else ():
        print(f"MISMATCH: {r['workload']} {r['what']}: before and now differ")
    print(f"wrote {out}/table.md, results.json, ratios.json, qkv_layout.json")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
