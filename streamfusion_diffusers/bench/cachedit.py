"""Cache-DiT (cache-dit 1.5.3) as a baseline of whole generations: its context parallelism over the diffusers
pipeline, caching off, so that every step is computed (what users compare when they want the same images).

`cache_dit.enable_cache(pipe, cache_config=None, parallelism_config=ParallelismConfig(...))` with no cache
config installs parallelism only. Rows, each its own system (a separate row in the table):
- cache-dit: Ulysses, Ring or USP (Ulysses x Ring; cache-dit asks for 4 ranks or more), exact up to rounding;
- cache-dit-fp8: its FP8 Ulysses all-to-all (`ulysses_float8`; it keeps K and the LSE in bf16): lossy;
- cache-dit-async: its asynchronous Ulysses (`ulysses_async`), which overlaps the Q, K, V all-to-alls with the
  projections; cache-dit 1.5.3 has it for Flux, Flux.2 and Qwen-Image transformers only.
Its data-parallel VAE decode is on where cache-dit has a planner for the pipeline's VAE (ours splits the decode
too). cache-dit is imported only when a row runs: it is an optional extra, and places rank r on accelerator r
as diffusers' context parallelism does, so it runs on GPUs only.
"""
from __future__ import annotations

import importlib.util
from typing import Any

SYSTEMS = ("cache-dit", "cache-dit-fp8", "cache-dit-async")
LOSSY = ("cache-dit-fp8",)
INSTALL_HINT = "pip install 'streamfusion-diffusers[cachedit]' (cache-dit 1.5.3)"
ASYNC_FAMILIES = ("flux", "flux2", "qwen-image")  # model families (models/) whose transformer it patches
# the VAE classes cache-dit 1.5.3 registers a data-parallel decode planner for
VAES = ("AutoencoderKL", "AutoencoderKLFlux2", "AutoencoderKLQwenImage", "AutoencoderKLWan",
        "AutoencoderKLHunyuanVideo", "AutoencoderKLLTX2Video")


def missing() -> str | None:
    """Why cache-dit cannot run here, or None; tried on every rank before the job, so all ranks skip it alike."""
    if importlib.util.find_spec("cache_dit") is None:
        return f"not installed ({INSTALL_HINT})"
    try:
        import cache_dit  # noqa: F401
    except Exception as err:  # noqa: BLE001 - a broken install names itself
        return f"it does not import ({type(err).__name__}: {err})"
    return None


def why_not(system: str, ulysses: int, ring: int, family: str) -> str | None:
    """Why cache-dit cannot run `system` at Ulysses x Ring for a model family, or None."""
    if ulysses > 1 and ring > 1 and ulysses * ring < 4:
        return "cache-dit runs Ulysses x Ring on 4 ranks or more"
    if system != "cache-dit" and ring > 1:
        return f"{system} is a Ulysses mode: its rows run Ulysses alone"
    if system == "cache-dit-async" and family not in ASYNC_FAMILIES:
        return f"cache-dit 1.5.3 has no asynchronous Ulysses for {family}"
    return None


def parallelism_options(system: str, ulysses: int, ring: int) -> dict[str, Any]:
    """Keyword arguments of cache_dit.ParallelismConfig for one row (a degree of 1 is left unset, as cache-dit
    wants)."""
    return {"ulysses_size": ulysses if ulysses > 1 else None, "ring_size": ring if ring > 1 else None,
            "ulysses_float8": system == "cache-dit-fp8", "ulysses_async": system == "cache-dit-async"}


def layout(system: str, ulysses: int, ring: int, vae: bool) -> str:
    """The row's layout as cache-dit's options, lossy ones marked."""
    options = parallelism_options(system, ulysses, ring)
    said = [f"{k}={v}" for k, v in options.items() if v not in (None, False)]
    said += ["vae decode data-parallel"] if vae else []
    return ", ".join(said) + (" (lossy)" if system in LOSSY else "")


def parallel_vae(pipe: Any) -> bool:
    return type(getattr(pipe, "vae", None)).__name__ in VAES


def enable(pipe: Any, system: str, ulysses: int, ring: int) -> Any:
    """Install cache-dit's parallelism (caching off) on `pipe`, for good: the caller hands it a fresh transformer."""
    import cache_dit

    config = cache_dit.ParallelismConfig(**parallelism_options(system, ulysses, ring),
                                         extra_parallel_modules=[pipe.vae] if parallel_vae(pipe) else [])
    return cache_dit.enable_cache(pipe, cache_config=None, parallelism_config=config)
