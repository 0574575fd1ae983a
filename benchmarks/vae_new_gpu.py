"""Device check of the VAE decode over ranks for the new models' VAEs, real size, random weights, bf16.

Wan 2.1's VAE (Wan 2.1 and Wan 2.2 T2V-A14B: 81 frames at 720 x 1280), Wan 2.2's (TI2V-5B: z_dim 48, patchified,
121 frames at 704 x 1280), Qwen-Image's (1328 x 1328) and Flux.2's (2048 x 2048) each decoded once per strategy
of `decode_over_ranks` that can take it: "one-rank" (rank 0 decodes untiled, the others wait for its broadcast),
"patch-parallel" (one band of latent rows per rank), and "tiles" (diffusers' tiles shared out) where the class has
them. One line each: time of the slowest rank, peak memory of the fullest, relative difference to the untiled
decode (bf16: cuDNN picks other kernels for a band's shapes). Each strategy is warmed up once on a small latent.

torchrun --nproc-per-node 1 benchmarks/vae_new_gpu.py [--frames N] [--only wan2.1,...] [--out DIR] [--tiny]
(any --nproc-per-node: the patch-parallel and tile rows then split over that many GPUs; --tiny: a CPU smoke run)
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from diffusers import AutoencoderKLFlux2, AutoencoderKLQwenImage, AutoencoderKLWan

from streamfusion_diffusers import shutdown
from streamfusion_diffusers.bench.layer import device_of_job
from streamfusion_diffusers.core.logs import quiet_third_party
from streamfusion_diffusers.diffusers.vae.bands import parallel_decode
from streamfusion_diffusers.diffusers.vae.one_rank import one_rank_decode
from streamfusion_diffusers.diffusers.vae.tiles import TILED, split_decode

# the real VAE configs (vae/config.json) where they differ from the class defaults; latents mean / std unused here
WAN22_VAE = {"base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "in_channels": 12, "out_channels": 12,
             "is_residual": True, "patch_size": 2, "scale_factor_spatial": 16,
             "latents_mean": [0.0] * 48, "latents_std": [1.0] * 48}
# name, class, config, latent shape for the real size (frames: latent frames, from --frames pixel frames)
VAES: dict[str, tuple[type, dict, Callable[[int | None], tuple[int, ...]]]] = {
    "wan2.1": (AutoencoderKLWan, {}, lambda f: (1, 16, 1 + ((f or 81) - 1) // 4, 90, 160)),
    "wan2.2": (AutoencoderKLWan, WAN22_VAE, lambda f: (1, 48, 1 + ((f or 121) - 1) // 4, 44, 80)),
    "qwenimage": (AutoencoderKLQwenImage, {}, lambda f: (1, 16, 1, 166, 166)),
    "flux2": (AutoencoderKLFlux2, {}, lambda f: (1, 32, 256, 256)),
}
SMALL = dict(base_dim=8, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True])
TINY = {  # --tiny: config and latent shape (3 latent frames go through the causal cache)
    "wan2.1": ({**SMALL, "z_dim": 4, "latents_mean": [0.0] * 4, "latents_std": [1.0] * 4}, (1, 4, 3, 7, 5)),
    "wan2.2": ({**WAN22_VAE, **SMALL, "decoder_base_dim": 12, "z_dim": 6, "latents_mean": [0.0] * 6,
                "latents_std": [1.0] * 6}, (1, 6, 3, 7, 5)),
    "qwenimage": ({**SMALL, "z_dim": 4, "latents_mean": [0.0] * 4, "latents_std": [1.0] * 4}, (1, 4, 1, 7, 5)),
    "flux2": ({"block_out_channels": (8, 16, 16, 16), "layers_per_block": 1, "norm_num_groups": 4,
               "latent_channels": 4}, (1, 4, 7, 5)),
}


def _strategies(vae: torch.nn.Module, rank: int, world: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    calls = {"one-rank": lambda z: one_rank_decode(vae, z),
             "patch-parallel": lambda z: parallel_decode(vae, z, rank, world)}
    if isinstance(vae, TILED):
        calls["tiles"] = lambda z: split_decode(vae, z, rank, world)
    return calls


def _slowest(value: float, device: torch.device) -> float:
    t = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _timed(call: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """One decode: its output, the slowest rank's milliseconds and the fullest rank's peak GiB."""
    device = z.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    start = time.perf_counter()
    out = call(z)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ms = (time.perf_counter() - start) * 1e3
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return out, _slowest(ms, device), _slowest(peak, device)


def vae_lines(name: str, frames: int | None, tiny: bool, dtype: torch.dtype) -> list[dict]:
    """One VAE decoded once per strategy that can take it, after a warm-up on a small latent."""
    cls, config, shape_of = VAES[name]
    config, shape = TINY[name] if tiny else (config, shape_of(frames))
    rank, world, device = dist.get_rank(), dist.get_world_size(), device_of_job()
    torch.manual_seed(0)
    with torch.device(device):
        vae = cls(**config).to(dtype).eval()
    small = (*shape[:-2], max(world, shape[-2] // 4), max(1, shape[-1] // 4))
    z = torch.randn(shape, generator=torch.Generator(device).manual_seed(1), device=device, dtype=dtype)
    rows, untiled = [], None
    with torch.inference_mode():
        for strategy, call in _strategies(vae, rank, world).items():
            call(z[..., :small[-2], :small[-1]].contiguous())  # warm-up: cuDNN's choices, allocator
            out, ms, peak = _timed(call, z)
            untiled = out if untiled is None else untiled  # one-rank runs first: the untiled decode
            rel = float((out.float() - untiled.float()).norm() / untiled.float().norm())
            rows.append({"vae": name, "strategy": strategy, "ranks": world, "latent": list(shape),
                         "dtype": str(dtype).removeprefix("torch."), "ms": ms, "peak_gib": peak,
                         "rel_vs_untiled": rel, "sample": list(out.shape)})
            del out
    del vae, untiled
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=",".join(VAES), help=f"comma-separated, of {', '.join(VAES)}")
    parser.add_argument("--frames", type=int, default=None,
                        help="pixel frames of the Wan videos (default 81 for Wan 2.1's VAE, 121 for Wan 2.2's)")
    parser.add_argument("--tiny", action="store_true", help="tiny VAEs and latents in float32 (a CPU smoke run)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="write the rows to OUT/vae_new.json")
    args = parser.parse_args()
    quiet_third_party(verbose=False)  # diffusers' note on casting a VAE built in float32 with .to()
    names = [n.strip() for n in args.only.split(",")]
    if unknown := sorted(set(names) - set(VAES)):
        parser.error(f"unknown --only {unknown}: pick from {', '.join(VAES)}")
    gpu = torch.cuda.is_available() and not args.tiny
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if gpu else "gloo")
    dtype = torch.bfloat16 if gpu else torch.float32
    rows = [row for name in names for row in vae_lines(name, args.frames, args.tiny, dtype)]
    if dist.get_rank() == 0:
        for r in rows:
            print(f"{r['vae']:9} latent {'x'.join(map(str, r['latent'])):18} {r['dtype']} {r['strategy']:14} "
                  f"{r['ranks']} rank(s): {r['ms']:9.1f} ms, peak {r['peak_gib']:5.1f} GiB, "
                  f"rel vs untiled {r['rel_vs_untiled']:.1e}")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "vae_new.json"), "w") as f:
                json.dump(rows, f, indent=1)
    shutdown()


if __name__ == "__main__":
    main()
