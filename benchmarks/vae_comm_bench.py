"""Device check of the VAE decode split and of 1-byte inter-machine transfers, on 2 GPUs:

1. one Flux 4096 px attention layer on an emulated 2 x 1 p4de cluster (Torus T2, and USP U1R2 whose ring
   crosses the link), with plain bf16, fp8 and int8 transfers: time, ratio to bf16, relative error against the
   exact answer, issue 14's bar on the Torus layer; and the compute-stream cost of each codec: encode + decode
   of one of the layer's Torus chunks beside a plain copy of it (the layer moves 4 per rank: Q, K, V, O);
2. the real-size Flux (2048 px) and CogVideoX-5b (49 frames, 480 x 720) VAE decodes, random weights, in bf16:
   untiled on one GPU (the others idle), diffusers' tiles shared out (`diffusers/vae/tiles.py`) and patch-parallel
   (`diffusers/vae/bands.py`) over all GPUs, CUDA events, min / median / max of the slowest rank, ratios to one GPU,
   each output's difference to the untiled one; then the same VAEs smaller in float32 (TF32 off), where the
   patch-parallel decode must equal the untiled one to float rounding.

torchrun --nproc-per-node P benchmarks/vae_comm_bench.py [--parts layer|vae] [--out DIR] [--tiny: CPU smoke run]
(the layer part needs P = 2)
(streamfusion bench --level e2e times the VAE decode inside whole generations too: its decode column)
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from diffusers import AutoencoderKL, AutoencoderKLCogVideoX

from streamfusion_diffusers import shutdown
from streamfusion_diffusers.backends.quantized import CODECS
from streamfusion_diffusers.bench.layer import Case, Setup, bench_layer, device_of_job, padded_length
from streamfusion_diffusers.choice.workloads import parse_workload
from streamfusion_diffusers.commands.timing import interleaved_ms
from streamfusion_diffusers.diffusers.vae.bands import parallel_decode
from streamfusion_diffusers.diffusers.vae.tiles import split_decode
from streamfusion_diffusers.models.configs import COGVIDEOX_5B_VAE, FLUX_DEV_VAE

LAYER_WORKLOAD = "flux-dev:4096"
TINY_LAYER_WORKLOAD = "flux-dev:256"  # --tiny: the CPU smoke run's layer
BAR = (0.7, 2e-2)  # issue 14: a Torus layer with 1-byte transfers <= 0.7 x the bf16 one, rel err <= 2e-2
VAES = (("flux 2048 px", AutoencoderKL, FLUX_DEV_VAE, (1, 16, 256, 256)),
        ("cogvideox 49 x 480 x 720", AutoencoderKLCogVideoX, COGVIDEOX_5B_VAE, (1, 16, 13, 60, 90)))
# float32 (TF32 off) at smaller sizes, as the CPU tests check: the patch-parallel decode is the untiled one
EXACT_VAES = (("flux 512 px", AutoencoderKL, FLUX_DEV_VAE, (1, 16, 64, 64)),
              ("cogvideox 9 x 240 x 360", AutoencoderKLCogVideoX, COGVIDEOX_5B_VAE, (1, 16, 3, 30, 45)))
LOWP_TOL = {"fp8": 5e-2, "int8": 2e-2}
# patch-parallel vs untiled: float32 rounding; in bf16, cuDNN picks other conv kernels for a band's shapes
EXACT_TOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}
BAR_4GPU = 0.35  # issue 14: decode on 4 GPUs <= 0.35 x the single-GPU decode


def layer_table(iters: int, dtype: torch.dtype, spec: str) -> list[tuple[str, bool | None]]:
    cases = [Case("torus", ulysses=2, ring=1, torus=2), Case("usp", ulysses=1, ring=2)]
    rows: dict[str | None, list[dict]] = {}
    for comm in (None, "fp8", "int8"):
        setup = Setup(parse_workload(spec), 2, 1, "torch", "p4de", dtype, iters, 3, 0, comm_dtype=comm)
        rows[comm] = [r for r in bench_layer(setup, cases) if r["method"] != "bound"]
    lines: list[tuple[str, bool | None]] = []
    for i, case in enumerate(cases):
        base = rows[None][i]
        lines.append((f"layer {spec}, 2x1 p4de, {case.label}, plain: {base['ms']:.1f} ms, "
                      f"rel err {base['rel_err']:.1e}", base["rel_err"] <= 1e-2))
        for comm in ("fp8", "int8"):
            row = rows[comm][i]
            ratio = row["ms"] / base["ms"]
            lines.append((f"layer {spec}, 2x1 p4de, {case.label}, {comm}: {row['ms']:.1f} ms = "
                          f"{ratio:.2f} x plain, rel err {row['rel_err']:.1e}", row["rel_err"] <= LOWP_TOL[comm]))
            if case.method == "torus":
                lines.append((f"issue 14 bar, {case.label} {comm}: {ratio:.2f} x plain (<= {BAR[0]}), rel err "
                              f"{row['rel_err']:.1e} (<= {BAR[1]:g})", ratio <= BAR[0] and row["rel_err"] <= BAR[1]))
    return lines + codec_lines(iters, dtype, spec)


def codec_lines(iters: int, dtype: torch.dtype, spec: str) -> list[tuple[str, None]]:
    """Encode + decode of one Torus chunk of the layer (a rank's tokens x its heads) per codec, beside a copy."""
    w, device = parse_workload(spec), device_of_job()
    x = torch.randn(1, padded_length(w, 2) // 2, w.heads // 2, w.head_dim, device=device, dtype=dtype)
    out = torch.empty_like(x)
    calls = [lambda: out.copy_(x)] + [lambda c=c: c.decode(c.encode(x), out) for c in CODECS.values()]
    stats = interleaved_ms(calls, iters, 3, device)
    names = ["copy"] + [f"{name} encode + decode" for name in CODECS]
    return [(f"chunk {list(x.shape)} {str(dtype).removeprefix('torch.')}: " +
             ", ".join(f"{n} {st.median:.2f} ms" for n, st in zip(names, stats)), None)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _peak_gib(device: torch.device) -> float:
    """This decode's peak memory on the fullest rank (0 on the CPU)."""
    peak = torch.tensor(torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0,
                        dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()


def vae_rows(name: str, cls: type, config: dict, shape: tuple[int, ...], dtype: torch.dtype, iters: int) -> dict:
    """One VAE decoded three ways: untiled on rank 0 alone (the others idle), the tile split, patch-parallel."""
    rank, world, device = dist.get_rank(), dist.get_world_size(), device_of_job()
    torch.manual_seed(0)
    with torch.device(device):
        vae = cls(**config).to(dtype).eval()
    vae.use_tiling = False  # the one-GPU reference is the untiled decode; the split reads the tile grid itself
    z = torch.randn(shape, generator=torch.Generator(device).manual_seed(1), device=device, dtype=dtype)
    calls = {"one GPU untiled": lambda: type(vae)._decode(vae, z).sample if rank == 0 else None,
             "tile split": lambda: split_decode(vae, z, rank, world),
             "patch-parallel": lambda: parallel_decode(vae, z, rank, world)}
    out, peak = {}, {}
    with torch.inference_mode():
        for how, call in calls.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            out[how] = call()
            peak[how] = _peak_gib(device)
        stats = interleaved_ms(list(calls.values()), iters, 1, device) if iters else [None] * len(calls)
    whole = out["one GPU untiled"]
    rows = [{"method": how, "peak_gib": peak[how], **(st.row() if st else {}),
             "rel_vs_untiled": None if whole is None else _rel(out[how], whole)} for how, st in zip(calls, stats)]
    del vae, out
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"vae": name, "dtype": str(dtype).removeprefix("torch."), "latent": list(shape), "world": world,
            "rows": rows}


def _vaes(tiny: bool, exact: bool) -> list[tuple[str, type, dict, tuple[int, ...]]]:
    if tiny:  # small layers and latents, timed and checked once: a CPU smoke run of a few seconds
        if exact:
            return []
        small = dict(block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=4)
        return [("tiny flux", AutoencoderKL, {**FLUX_DEV_VAE, **small}, (1, 16, 12, 10)),
                ("tiny cogvideox", AutoencoderKLCogVideoX, {**COGVIDEOX_5B_VAE, **small}, (1, 16, 3, 8, 10))]
    return EXACT_VAES if exact else VAES


def vae_results(iters: int, dtype: torch.dtype, tiny: bool) -> list[dict]:
    """Real-size decodes timed in `dtype`, then smaller ones in float32 (TF32 off) to show the split is exact."""
    results = [vae_rows(*v, dtype, iters) for v in _vaes(tiny, exact=False)]
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        results += [vae_rows(*v, torch.float32, 0) for v in _vaes(tiny, exact=True)]
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    return results


def vae_table(results: list[dict]) -> list[tuple[str, bool | None]]:
    """Rank 0's table (the untiled reference lives there) and its PASS / FAIL lines."""
    lines: list[tuple[str, bool | None]] = [
        ("| vae | dtype | method | median ms (min - max) | x untiled | rel diff vs untiled | peak GiB |", None)]
    for res in results:
        base = res["rows"][0].get("ms")
        for row in res["rows"]:
            timed = f"{row['ms']:.0f} ({row['min_ms']:.0f} - {row['max_ms']:.0f}) | {row['ms'] / base:.2f}" \
                if base else "- | -"
            lines.append((f"| {res['vae']} | {res['dtype']} | {row['method']} | {timed} | "
                          f"{row['rel_vs_untiled']:.1e} | {row['peak_gib']:.1f} |", None))
    for res in results:
        ours = res["rows"][2]
        # issue 14: equal to the untiled decode within the tolerance of diffusers' own tiled decode; float32 (where
        # rounding cannot hide a wrong halo) must be exact, low precision may differ as much as the tiles do
        tiled = res["rows"][1]["rel_vs_untiled"]
        tol = EXACT_TOL[res["dtype"]] if res["dtype"] == "float32" else max(EXACT_TOL[res["dtype"]], tiled)
        lines.append((f"vae {res['vae']} {res['dtype']}: patch-parallel over {res['world']} ranks vs one-GPU untiled "
                      f"rel diff {ours['rel_vs_untiled']:.1e} (<= {tol:.1e}; tile split {tiled:.1e})",
                      ours["rel_vs_untiled"] <= tol))
        if "ms" in ours and res["world"] >= 4:  # issue 14's bar, set for 4 GPUs
            ratio = ours["ms"] / res["rows"][0]["ms"]
            lines.append((f"vae {res['vae']}: patch-parallel on {res['world']} GPUs {ratio:.2f} x one GPU "
                          f"(bar <= {BAR_4GPU})", ratio <= BAR_4GPU))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layer-iters", type=int, default=10)
    parser.add_argument("--vae-iters", type=int, default=5)
    parser.add_argument("--parts", default="layer,vae",
                        help="comma-separated: layer (1-byte transfers), vae (decode split); default both")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny layer, VAEs and latents, timed once (a CPU smoke run)")
    parser.add_argument("--out", default=None, help="write the vae part's rows to OUT/vae.json")
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if gpu else "gloo")
    dtype = torch.bfloat16 if gpu else torch.float32
    parts = {p.strip() for p in args.parts.split(",")}
    spec = TINY_LAYER_WORKLOAD if args.tiny else LAYER_WORKLOAD
    lines = layer_table(1 if args.tiny else args.layer_iters, dtype, spec) if "layer" in parts else []
    results = vae_results(args.vae_iters, dtype, args.tiny) if "vae" in parts else []
    if dist.get_rank() == 0:
        lines += vae_table(results) if results else []
        for line, ok in lines:
            print(line if ok is None else f"{'PASS' if ok else 'FAIL'}  {line}")
        if args.out and results:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "vae.json"), "w") as f:
                json.dump(results, f, indent=1)
    shutdown()


if __name__ == "__main__":
    main()
