"""Every rank a share of the weights: a model's parameters sharded by torch FSDP2 (`fully_shard`) for inference.

Sequence parallelism splits the tokens and leaves every rank the whole model; `parallelize(..., shard_weights=True)`
splits the weights too. Each repeated block (the model's `_no_split_modules` classes: diffusers' transformer
blocks, transformers' encoder layers) becomes one FSDP unit, the model itself the root, so nothing stays whole:
between forwards every parameter is a DTensor holding 1/P of its rows on each rank; a block's parameters are
all-gathered just before it runs and freed after it (`reshard_after_forward=True`), and the next block's all-gather
is issued as soon as the current one's has landed (`set_modules_to_forward_prefetch`), so on GPUs it runs behind the
current block's compute. Mixed precision stays off (the weights gather in the dtype they are held in), so the
output is the unsharded model's.

Over which ranks: those that run every forward together, the whole job (with the CFG split too: both branches run
each forward at once, so the weights shard over all of them, half the bytes per rank of a per-branch split for the
same bytes received per all-gather); with `worlds` given (xDiT's data-parallel copies, which may run different
forwards), the rank's own world. A DeviceMesh over that process group of the context, never the default group;
on the CPU (gloo: the tests) a CPU DeviceMesh, and FSDP2 needs nothing else there.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from ..context import ParallelContext
from ..core.logs import say_once

logger = logging.getLogger(__name__)

CANNOT_UNDO = ("unparallelize cannot undo shard_weights=True (FSDP2 has no inverse): build or load the model "
               "again, or gather a full state dict first (torch.distributed.checkpoint.state_dict)")
NOT_WITH_GRAPHS = ("shard_weights=True does not compose with cuda_graph=True: FSDP2 gathers and frees each block's "
                   "weights every forward, which a captured graph cannot replay; drop one (torch.compile cuts a "
                   "step's fixed cost with sharded weights)")
NOT_QUANTIZED = ("shard_weights=True does not compose with quantized weights (torchao's tensor subclasses, which "
                 "FSDP2 cannot split): drop one")


def plain_weights(model: nn.Module) -> bool:
    """Whether every parameter is a plain tensor (no torchao quantized subclass), which FSDP2 can shard."""
    return all(type(p) in (torch.Tensor, nn.Parameter) for p in model.parameters())
# FSDP2's unshard under torch.inference_mode() raised "Inference tensors do not track version counter" until
# pytorch/pytorch#197327 (2026-09); torch 2.13 runs it (tests/test_shard_weights_p4.py).
INFERENCE_MODE_FIXED = (2, 13)


def weight_mesh(ctx: ParallelContext, device_type: str) -> DeviceMesh | None:
    """A 1-D DeviceMesh over the context's pipeline group (the ranks that run every forward together: the job, or
    this rank's world); None on one rank: nothing to shard."""
    group = ctx.pipeline_group
    if group.pg is None:
        return None
    return DeviceMesh.from_group(group.pg, device_type=device_type, mesh=torch.tensor(group.ranks),
                                 mesh_dim_names=("weights",))


def blocks_of(model: nn.Module) -> list[list[nn.Module]]:
    """The model's repeated blocks, in order, grouped by the list that holds them: the modules of its
    `_no_split_modules` classes (the ones diffusers and accelerate keep whole on one device), outermost only."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found: dict[int, list[nn.Module]] = {}
    inside: set[int] = set()
    for parent in model.modules():
        if id(parent) in inside:
            continue
        for child in parent.children():
            if type(child).__name__ in names and id(child) not in inside:
                found.setdefault(id(parent), []).append(child)
                inside.update(id(m) for m in child.modules())
    return list(found.values())


def shard_model(model: nn.Module, mesh: DeviceMesh) -> int:
    """fully_shard every block of the model, then the model as the root, for inference; returns the unit count.
    Each block prefetches the next one of its list in forward. Parameters on another device than the mesh's
    (built on the CPU) move there one unit at a time, so a GPU never holds more than its shards and one block."""
    groups = blocks_of(model)
    for blocks in groups:
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        for block, following in zip(blocks, blocks[1:]):
            block.set_modules_to_forward_prefetch([following])
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < INFERENCE_MODE_FIXED:
        model.register_forward_pre_hook(_refuse_inference_mode, prepend=True)  # before FSDP's own
    if hasattr(FSDPModule, "reset_iter_state"):  # torch >= 2.13
        model.register_forward_hook(_reset_after_error, always_call=True)
    return 1 + sum(len(blocks) for blocks in groups)


def _refuse_inference_mode(module: nn.Module, args: tuple) -> None:
    if torch.is_inference_mode_enabled():
        raise RuntimeError(f"sharded weights under torch.inference_mode() need torch >= 2.13 (this is "
                           f"{torch.__version__}): call the pipeline under torch.no_grad(), as diffusers does")


def _reset_after_error(module: FSDPModule, args: tuple, output: object) -> None:
    """A forward that raised leaves FSDP2's per-forward state undefined (blocks gathered, the root's forward still
    open): reshard and clear it, so the next forward starts clean."""
    if sys.exc_info()[1] is not None:
        module.reset_iter_state()


def shard_pipeline(target: nn.Module | object, transformers: list[nn.Module], ctx: ParallelContext) -> list[str]:
    """Shard the transformers and, for a pipeline, its text encoders (every `torch.nn.Module` component named
    text_encoder*: run once per prompt, their layers are gathered one at a time like the blocks'). Returns the
    names of what was sharded (for the log and run.json)."""
    parts: dict[str, nn.Module] = {f"transformer{'_2' if i else ''}": t for i, t in enumerate(transformers)}
    components = getattr(target, "components", None) or {}
    parts.update({name: c for name, c in components.items()
                  if name.startswith("text_encoder") and isinstance(c, nn.Module)})
    gpu = dist.get_backend() == "nccl"  # the mesh's device is the job's, wherever the model was built
    mesh = weight_mesh(ctx, "cuda" if gpu else "cpu")
    if mesh is None:
        say_once(logger, logging.INFO, "shard_weights: one rank, nothing to shard")
        return []
    for name, part in parts.items():
        units = shard_model(part, mesh)
        logger.debug("shard_weights: %s in %d FSDP units over %d ranks", name, units, mesh.size())
    say_once(logger, logging.INFO, "shard_weights: %s sharded over %d ranks", ", ".join(parts), mesh.size())
    return list(parts)


@contextmanager
def full_weights(model: nn.Module) -> Iterator[nn.Module]:
    """Every FSDP unit of a sharded model gathered whole for the block of code (collective: every rank enters it),
    resharded after: where code must see the whole weights, such as peft adding LoRA adapters after the sharding
    (it sizes them from the weight it finds). The adapters' own parameters stay whole on every rank."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    try:
        yield model
    finally:
        for unit in units:
            unit.reshard()


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def local_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes this rank holds, bytes of the whole model) of the model's parameters: a sharded parameter counts its
    local shard (DTensor.to_local()) against its global size."""
    held = whole = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        held += local.numel() * local.element_size()
        whole += p.numel() * p.element_size()
    return held, whole


__all__ = ["CANNOT_UNDO", "NOT_QUANTIZED", "NOT_WITH_GRAPHS", "blocks_of", "full_weights", "is_sharded", "local_bytes",
           "plain_weights", "shard_model", "shard_pipeline", "weight_mesh"]
