"""What an xfuser job is made of, and the streamfusion layout that runs inside it (no xfuser import here).

xfuser orders ranks "tp-sp-pp-cfg-dp": every sequence-parallel (SP) group is a block of adjacent ranks, one per
CFG branch and data-parallel replica, and SP rank i holds the i-th equal slice of the image/video tokens. Our
context spans exactly those ranks (`worlds`), so the CFG split, the data parallelism and the token sharding
stay xfuser's; only the attention inside each SP group becomes ours.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..core.config import ParallelConfig

FAMILIES = {"FluxTransformer2DModel": "flux", "CogVideoXTransformer3DModel": "cogvideox"}
# xfuser's attention backends that compute exact softmax attention, as ours does: picking one is harmless (ours
# runs instead, its kernel chosen by kernel=); the others (FP8/FP4, Sage, sparse) would silently change the maths.
EXACT_BACKENDS = {"SDPA", "SDPA_MATH", "SDPA_EFFICIENT", "SDPA_FLASH", "FLASH", "CUDNN", "FLASH_3", "FLASH_4"}


@dataclass(frozen=True)
class XDiTJob:
    """The parts of a built xfuser pipeline that decide what we can replace, read once by `enable`."""

    model: str  # class name of the diffusers transformer inside xfuser's wrapper
    sp_worlds: tuple[tuple[int, ...], ...]  # every SP group of the job, global ranks in SP-rank order
    world_size: int  # processes in the whole job
    ulysses: int = 1
    ring: int = 1
    pipefusion: int = 1
    pipeline_patches: int = 1
    tensor_parallel: int = 1
    fast_attn: bool = False
    fp8_comms: bool = False
    vae_workers: int = 0
    attention_backend: str | None = None  # --attention_backend, None: xfuser picks an exact one
    hybrid_attention: bool = False  # --use_hybrid_attn_schedule
    onediff: bool = False  # --use_onediff: a compiled forward would keep xfuser's attention

    @property
    def sp_degree(self) -> int:
        return len(self.sp_worlds[0])

    @property
    def family(self) -> str:
        return FAMILIES[self.model]


def refuse_unsupported(job: XDiTJob) -> None:
    """Raise, before anything is changed, for what our attention cannot stand in for; name what to turn off."""
    if job.model not in FAMILIES:
        raise ValueError(f"streamfusion's xDiT adapter runs Flux (xFuserFluxPipeline) and CogVideoX "
                         f"(xFuserCogVideoXPipeline); this pipeline's transformer is {job.model}: run it without "
                         f"streamfusion_diffusers.xdit.enable")
    turn_off = []
    if job.pipefusion > 1:
        turn_off.append(f"PipeFusion (--pipefusion_parallel_degree {job.pipefusion}: use 1)")
    if job.pipeline_patches > 1:
        turn_off.append(f"PipeFusion's patch pipeline and its KV cache (--num_pipeline_patch {job.pipeline_patches}:"
                        f" use 1)")
    if job.tensor_parallel > 1:
        turn_off.append(f"tensor parallelism (--tensor_parallel_degree {job.tensor_parallel}: use 1)")
    if job.fast_attn:
        turn_off.append("DiTFastAttn (drop --use_fast_attn)")
    if job.fp8_comms:
        turn_off.append("FP8 Ulysses communication (drop --use_fp8_comms)")
    if job.vae_workers > 0:
        turn_off.append(f"separate VAE workers (--vae_parallel_size {job.vae_workers}: use 0)")
    if job.attention_backend is not None and job.attention_backend.upper() not in EXACT_BACKENDS:
        turn_off.append(f"xfuser's {job.attention_backend} attention (drop --attention_backend {job.attention_backend}: "
                        f"ours computes exact attention)")
    if job.hybrid_attention:
        turn_off.append("xfuser's hybrid attention schedule (drop --use_hybrid_attn_schedule)")
    if job.onediff:
        turn_off.append("OneDiff compilation (drop --use_onediff; --use_torch_compile works)")
    if turn_off:
        raise ValueError("streamfusion replaces xfuser's sequence-parallel attention only; turn off "
                         + ", ".join(turn_off) + " to run it with streamfusion")


def machines_of(world: Sequence[int], world_size: int, machines: int) -> int:
    """How many of the job's `machines` one SP group spans (ranks fill machines in order, as launchers place them)."""
    if machines < 1 or world_size % machines:
        raise ValueError(f"machines={machines} does not divide the job's {world_size} processes; pass the number of "
                         f"machines the job runs on (--sf-machines / machines=)")
    per_machine = world_size // machines
    spanned = sorted({rank // per_machine for rank in world})
    if len(world) % len(spanned) or any(sum(r // per_machine == m for r in world) != len(world) // len(spanned)
                                        for m in spanned):
        raise ValueError(f"the sequence-parallel group {list(world)} sits unevenly on machines of {per_machine} GPUs; "
                         f"make the SP degree a divisor or a multiple of the GPUs per machine")
    return len(spanned)


def parallel_config(job: XDiTJob, method: str, machines: int, backend: str, **overrides: Any) -> ParallelConfig:
    """Our layout over one SP group: xfuser's Ulysses x Ring degrees unless overridden, placed on the machines
    the group spans. Methods 'ulysses' and 'ring' imply their degrees and 'auto' chooses them (choice.choose,
    for the SP group's machines, at the first attention call), so xfuser's are not passed to them."""
    if overrides.get("cfg", 1) != 1:
        raise ValueError("xfuser splits the guidance batch itself: drop cfg= and use xfuser's --use_cfg_parallel")
    n = machines_of(job.sp_worlds[0], job.world_size, machines)
    degrees = {} if method in ("ulysses", "ring", "auto") else {"ulysses": job.ulysses, "ring": job.ring}
    fields = {"machines": n, "gpus_per_machine": job.sp_degree // n, "method": method, "backend": backend,
              **degrees, **overrides}
    if "ulysses" in overrides and "ring" not in overrides and degrees:
        fields["ring"] = None  # a new Ulysses degree alone: the ring degree follows from it
    if "ring" in overrides and "ulysses" not in overrides and degrees:
        fields["ulysses"] = None
    return ParallelConfig(**fields)
