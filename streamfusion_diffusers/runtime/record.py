"""What one call of a job's pipeline says it ran: run.json, and `serve`'s answers (sizes, layout and why, backend,
what was sharded and how, graphs, per-step and phase times, bytes across emulated machines).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from ..context import ParallelContext
from .build import Prepared
from .job import Job
from .phases import PhaseTimer


def crossed(ctx: ParallelContext) -> dict[str, int] | None:
    """What this rank has sent and received across (emulated) machines so far, as the emulated link counts it
    (backends/emulated.py's Crossed); None without --emulate-link."""
    counted = getattr(ctx.transport, "counted", None)
    return None if counted is None else dataclasses.asdict(counted)


def crossed_since(ctx: ParallelContext, before: dict[str, int] | None) -> dict[str, int] | None:
    """What this rank sent and received across machines since `before` (`crossed` then): one call's share."""
    now = crossed(ctx)
    return None if now is None or before is None else {key: now[key] - before[key] for key in now}


def run_record(job: Job, prepared: Prepared, result: Any, phases: PhaseTimer, generate_s: float,
               build_s: float, moved: dict[str, int] | None = None, once: dict[str, float] | None = None) -> dict:
    """What ran (run.json, and `serve`'s answers): sizes, layout and why, backend, per-step and phase times.
    `moved`: what rank 0 sent and received across emulated machines in this call (`crossed_since`; a replayed
    CUDA graph posts nothing, so only its capture counts). `once`: rank 0's one-time work in this call, by kind
    (core/one_time.py: what a new shape's first step spends beside its compute)."""
    ctx = prepared.ctx
    config = prepared.transformer.config
    heads = config.get("num_attention_heads") or config["n_heads"]  # Z-Image names its heads n_heads
    return {
        "model": job.model, "weights": job.weights or "random", "prompt": job.prompt,
        "height": job.height, "width": job.width, "frames": job.frames if job.spec.video else None,
        "output_size": _output_size(job, result),
        "steps": job.steps, "guidance_scale": job.guidance_scale, "true_cfg_scale": job.true_cfg_scale,
        "seed": job.seed, "weights_seed": None if job.weights else job.weights_seed, "dtype": job.dtype,
        "deterministic": job.deterministic,
        "device": "cuda" if job.gpu else "cpu", "world_size": job.world_size,
        "config": {**dataclasses.asdict(job.parallel), "native_steps": list(job.parallel.native_steps)},  # as JSON
        "vae_split": job.vae_split,
        "vae_decode": prepared.transformer._streamfusion.vae_decode or "rank 0",  # how the VAE decoded
        "encoded_first": "prompt_embeds" in prepared.prompt,  # encoder freed before the transformer was built
        "cuda_graph": {"on": job.cuda_graph, "why": job.graph_why, **graph_record(prepared.pipe)},
        "compile": {"on": job.compile, "why": job.compile_why, "cache": job.compile_cache},
        "shard_weights": job.shard_weights,
        "streamed_blocks": job.streamed_blocks,  # asked for; weight_split.tensor_parallel: the parts that ran so
        "sharded": list(prepared.transformer._streamfusion.sharded),  # what was sharded (none on one rank)
        "weight_split": _split_record(prepared.transformer._streamfusion.split),
        "stack": prepared.stack,  # the cache, LoRAs and quantization that ran ({} for none)
        "backend": f"{ctx.transport.name} over {dist.get_backend()}",  # after any fallback
        "crossed": moved,
        "layout": layout_record(ctx, heads), "cfg": ctx.cfg.degree,
        "attention": _attention_record(ctx, heads),
        "attention_precision": _precision_record(job),
        "step_latency_s": phases.step_latencies, "phases_s": phases.seconds, "one_time_s": once or {},
        "generate_s": generate_s, "build_s": build_s,
        "startup_s": prepared.startup_s if build_s else {},  # a one-request job's start-up, by stage
        "total_s": build_s + generate_s,
        "peak_memory_gib": torch.cuda.max_memory_allocated(prepared.device) / 2**30 if job.gpu else None,  # rank 0's
    }


def graph_record(pipe: Any) -> dict[str, Any]:
    """What the CUDA graphs of this process did so far (summed over a pipeline's transformers; {} when off)."""
    from ..diffusers.graphs import graph_hooks

    hooks = graph_hooks(pipe)
    if not hooks:
        return {}
    records = [hook.stats.record() for hook in hooks]
    return {key: sum(r[key] for r in records) if key != "budget_gib" else records[0][key] for key in records[0]}


def layout_record(ctx: ParallelContext, heads: int) -> str:
    """The SP layout that ran; with method "auto" and no sequence-parallel attention call (every block ran
    tensor-parallel), none."""
    if ctx.config.method == "auto" and not any(key[1] == heads for key in ctx.chosen):
        return "none (no sequence-parallel attention ran)"
    return str(ctx.layout(heads))


def _attention_record(ctx: ParallelContext, heads: int) -> list[dict]:
    """The layout each attention shape ran and why: method "auto"'s recipe entry or cost-model prediction,
    else the layout asked for."""
    if ctx.config.method != "auto":
        return [{"layout": str(ctx.layout(heads)), "kernel": ctx.config.kernel, "why": "asked for"}]
    return [{"tokens": key[0], "joint_tokens": key[3], "heads": key[1], "head_dim": key[2], "layout": str(c.layout),
             "kernel": c.kernel, "why": c.why} for key, c in ctx.chosen.items()]


def _precision_record(job: Job) -> dict[str, Any]:
    """What precision the attention ran in: native, or Q K^T in 8 bits on every step but the native first and last
    ones."""
    if job.parallel.kernel not in ("int8", "fp8"):
        return {"attention": "native"}
    first, last = job.parallel.native_steps
    return {"attention": job.parallel.kernel, "native_steps": [first, last],
            "quantized_steps": max(0, job.steps - first - last)}


def _split_record(split: Any) -> dict | None:
    """Blocks kept gathered per sharded part, GiB held per rank, weight GiB received per step, the parts whose
    streamed blocks ran tensor-parallel (None: not sharded)."""
    if split is None:
        return None
    return {"keep": split.keep, "held_gib": split.held / 2**30, "received_gib_per_step": split.received / 2**30,
            "tensor_parallel": list(split.tensor)}


def _output_size(job: Job, result: Any) -> dict:
    """The size the pipeline produced (what ran), as run.json records it."""
    if not job.spec.video:
        width, height = result.images[0].size
        return {"height": height, "width": width}
    frames = result.frames[0]
    width, height = frames[0].size
    return {"height": height, "width": width, "frames": len(frames)}


def one_time_text(record: dict, digits: int = 2) -> str:
    """A run record's one-time work (`one_time_s`) as words, kind by kind ("" for none)."""
    return ", ".join(f"{kind} {sec:.{digits}f} s" for kind, sec in (record.get("one_time_s") or {}).items())


__all__ = ["crossed", "crossed_since", "graph_record", "layout_record", "one_time_text", "run_record"]
