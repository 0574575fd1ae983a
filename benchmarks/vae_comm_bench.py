"""Device check of the VAE decode split and of 1-byte inter-machine transfers, on 2 GPUs:

1. one Flux 4096 px attention layer on an emulated 2 x 1 p4de cluster (Torus T2, and USP U1R2 whose ring
   crosses the link), with plain bf16, fp8 and int8 transfers: time, ratio to bf16, relative error against the
   exact answer;
2. the real-size Flux (2048 px) and CogVideoX-5b (49 frames, 480 x 720) VAE decodes, random weights: one GPU
   untiled and tiled (diffusers), and split over both GPUs; the split's difference to diffusers' tiled decode
   and diffusers' own tiled-vs-untiled difference.

torchrun --nproc-per-node 2 benchmarks/vae_comm_bench.py [--parts layer]   (streamfusion bench --level e2e times
the VAE decode inside whole generations too: its decode column, ours split against one GPU)
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from diffusers import AutoencoderKL, AutoencoderKLCogVideoX

from streamfusion_diffusers import shutdown
from streamfusion_diffusers.bench.command import parse_workload
from streamfusion_diffusers.bench.layer import Case, Setup, bench_layer, device_of_job
from streamfusion_diffusers.bench.timing import median_ms
from streamfusion_diffusers.models.configs import COGVIDEOX_5B_VAE, FLUX_DEV_VAE
from streamfusion_diffusers.vae import split_vae_decode, unsplit_vae_decode

LAYER_WORKLOAD = "flux-dev:4096"
VAES = (("flux 2048 px", AutoencoderKL, FLUX_DEV_VAE, (1, 16, 256, 256)),
        ("cogvideox 49 x 480 x 720", AutoencoderKLCogVideoX, COGVIDEOX_5B_VAE, (1, 16, 13, 60, 90)))
LOWP_TOL = {"fp8": 5e-2, "int8": 2e-2}
SPLIT_TOL = 1e-2  # split vs tiled: the same tiles, but cuDNN may pick other conv kernels per shape in bf16


def layer_table(iters: int, dtype: torch.dtype) -> list[tuple[str, bool]]:
    cases = [Case("torus", ulysses=2, ring=1, torus=2), Case("usp", ulysses=1, ring=2)]
    rows: dict[str | None, list[dict]] = {}
    for comm in (None, "fp8", "int8"):
        setup = Setup(parse_workload(LAYER_WORKLOAD), 2, 1, "torch", "p4de", dtype, iters, 3, 0, comm_dtype=comm)
        rows[comm] = [r for r in bench_layer(setup, cases) if r["method"] != "bound"]
    lines = []
    for i, case in enumerate(cases):
        base = rows[None][i]
        lines.append((f"layer {LAYER_WORKLOAD}, 2x1 p4de, {case.label}, plain: {base['ms']:.1f} ms, "
                      f"rel err {base['rel_err']:.1e}", base["rel_err"] <= 1e-2))
        for comm in ("fp8", "int8"):
            row = rows[comm][i]
            lines.append((f"layer {LAYER_WORKLOAD}, 2x1 p4de, {case.label}, {comm}: {row['ms']:.1f} ms = "
                          f"{row['ms'] / base['ms']:.2f} x plain, rel err {row['rel_err']:.1e}",
                          row["rel_err"] <= LOWP_TOL[comm]))
    return lines


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def vae_table(iters: int, dtype: torch.dtype) -> list[tuple[str, bool]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = device_of_job()
    lines = []
    for name, cls, config, shape in VAES:
        torch.manual_seed(0)
        with torch.device(device):
            vae = cls(**config).to(dtype).eval()
        z = torch.randn(shape, generator=torch.Generator(device).manual_seed(1), device=device, dtype=dtype)
        out = {}
        with torch.inference_mode():
            for how in ("untiled", "tiled", "split"):
                vae.use_tiling = how != "untiled"
                if how == "split":
                    split_vae_decode(vae, rank, world)
                out[how] = vae.decode(z).sample
                ms = median_ms(lambda: vae.decode(z), iters, 1, device)  # noqa: B023
                out[how + "_ms"] = ms
            unsplit_vae_decode(vae)
        vs_tiled, tiled_err = _rel(out["split"], out["tiled"]), _rel(out["tiled"], out["untiled"])
        lines.append((f"vae {name}: 1 GPU untiled {out['untiled_ms']:.0f} ms, tiled {out['tiled_ms']:.0f} ms; "
                      f"{world} GPUs split {out['split_ms']:.0f} ms = {out['split_ms'] / out['untiled_ms']:.2f} x "
                      f"untiled, {out['split_ms'] / out['tiled_ms']:.2f} x tiled; split vs tiled rel diff "
                      f"{vs_tiled:.1e}, tiled vs untiled {tiled_err:.1e}", vs_tiled <= SPLIT_TOL))
        del vae, out
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layer-iters", type=int, default=10)
    parser.add_argument("--vae-iters", type=int, default=2)
    parser.add_argument("--parts", default="layer,vae",
                        help="comma-separated: layer (1-byte transfers), vae (decode split); default both")
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if gpu else "gloo")
    dtype = torch.bfloat16 if gpu else torch.float32
    parts = {p.strip() for p in args.parts.split(",")}
    lines = layer_table(args.layer_iters, dtype) if "layer" in parts else []
    lines += vae_table(args.vae_iters, dtype) if "vae" in parts else []
    if dist.get_rank() == 0:
        for line, ok in lines:
            print(f"{'PASS' if ok else 'FAIL'}  {line}")
    shutdown()


if __name__ == "__main__":
    main()
