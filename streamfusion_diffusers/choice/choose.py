"""Which layout for this attention shape on this cluster: what `method="auto"` calls at the first sp_attention.

The answer is the recipe entry measured (or predicted) for the same heads and head size on the same cluster
shape, link and transport, at the nearest sequence length; without one, the cost model's fastest layout,
with the figures fitted in the recipe file's `calibration` header for the GPU it runs on (the device's own name:
the kinds differ in overheads) when there is one. Every rank must build
the same mesh, so rank 0's choice is broadcast (files may differ between machines).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.config import METHODS, Layout, ParallelConfig, resolve_layout
from ..context import ParallelContext
from ..core.links import PRESETS, Link, parse_link
from ..core.one_time import one_time
from ..core.transports import find_transport
from .costmodel import Gpu, Prediction, candidate_layouts, predict
from .recipe import Recipe, load_recipes
from .rules import TORUS_MIN_TOKENS_PER_GPU, tokens_per_gpu, torus_off, why_torus_off
from .workloads import MODELS as WORKLOADS, Workload

logger = logging.getLogger(__name__)

REAL_LINK = "real"  # the `link` of entries measured between real machines (not emulated)


@dataclass(frozen=True)
class Cluster:
    """What the layout depends on besides the attention shape. link: an --emulate-link spec or "real"."""

    machines: int
    gpus_per_machine: int
    link: str = REAL_LINK
    backend: str = "torch"

    @property
    def inter(self) -> Link:
        """The inter-machine link the cost model assumes: the emulated one, else a DGX-class fabric."""
        return PRESETS["dgx"] if self.link == REAL_LINK else parse_link(self.link)


@dataclass(frozen=True)
class Choice:
    layout: Layout
    kernel: str
    why: str


def transport_name(backend: str) -> str:
    """The transport a recipe entry's timings count as (core/transports.py's timed_as: "symm-pull" is torch's, the
    cost model does not tell the all-to-all's way apart); a name it does not know, as written."""
    spec = find_transport(backend)
    return spec.timed_as if spec else backend


def entry_workload(entry: dict, model: str) -> Workload | None:
    """The attention shape an entry was chosen for: written by `tune`, or implied by its model and size."""
    if "heads" in entry:
        return Workload(model, entry["tokens"], entry.get("text_tokens", 0), entry["heads"], entry["head_dim"], 1)
    if model in WORKLOADS:
        size = entry.get("resolution") or entry.get("frames")
        return WORKLOADS[model](size) if size else WORKLOADS[model]()
    return None


def entry_layout(entry: dict, heads: int) -> Layout:
    method = entry["method"]
    fixed = method in ("ulysses", "ring")
    config = ParallelConfig(machines=entry["machines"], gpus_per_machine=entry["gpus_per_machine"], method=method,
                            ulysses=None if fixed else entry.get("ulysses"), ring=None if fixed else entry.get("ring"),
                            torus=entry.get("torus") if method == "torus" else None)
    return resolve_layout(config, entry["machines"] * entry["gpus_per_machine"], heads)


def _matches(entry: dict, w: Workload | None, shape: Workload, cluster: Cluster) -> bool:
    link = entry.get("link")
    return (w is not None and (w.heads, w.head_dim) == (shape.heads, shape.head_dim)
            and (entry["machines"], entry["gpus_per_machine"]) == (cluster.machines, cluster.gpus_per_machine)
            and (cluster.machines == 1 or link == cluster.link))


def find_entry(recipes: list[Recipe], shape: Workload, cluster: Cluster) -> tuple[Recipe, dict] | None:
    """The entry for this shape and cluster at the nearest sequence length, of the same transport if any;
    the user's recipes (`streamfusion tune`'s) before the packaged ones."""
    seen = shape.tokens + shape.text_tokens
    found = []
    for recipe in recipes:
        for e in recipe.entries:
            w = entry_workload(e, recipe.model)
            if _matches(e, w, shape, cluster):
                other = transport_name(e.get("backend", "torch")) != transport_name(cluster.backend)
                found.append((other, recipe.packaged, abs(math.log((w.tokens + w.text_tokens) / seen)), recipe, e))
    if not found:
        return None
    *_, recipe, entry = min(found, key=lambda x: x[:3])
    return recipe, entry


def gpu_of(calibration: dict | None) -> Gpu:
    """The cost model's GPU with a recipe header's fitted figures (attention rates per head dim, overheads)."""
    known = {f.name for f in fields(Gpu)} - {"intra"}
    given = {k: v for k, v in (calibration or {}).items() if k in known}
    if "attention_tflops" in given:
        given["attention_tflops"] = {int(d): float(r) for d, r in given["attention_tflops"].items()}
    return Gpu(**given)


def schedule_key(lay: Layout) -> tuple:
    """Layouts with equal keys run the same schedule on the same ranks (placement matters only when both the
    intra-Ulysses and the ring degree exceed 1)."""
    return lay.ulysses, lay.ring, lay.torus, lay.ring_inner if lay.ulysses_intra > 1 and lay.ring > 1 else None


def ranked(w: Workload, cluster: Cluster, gpu: Gpu, elem_bytes: int = 2) -> list[Prediction]:
    """Every distinct layout of every method, fastest predicted layer first (ties: by name, so every rank and
    every run orders them alike). Layouts that run the same schedule on the same ranks appear once; Torus
    inside one machine only where the rule from the measurements (rules.py) lets it."""
    seen, out = set(), []
    for method in METHODS:
        for lay in candidate_layouts(method, cluster.machines, cluster.gpus_per_machine, w.heads):
            key = schedule_key(lay)
            if key not in seen and not torus_off(lay, w):
                seen.add(key)
                out.append(predict(lay, w, cluster.inter, gpu, elem_bytes))
    return sorted(out, key=lambda p: (p.layer_ms, str(p.layout)))


def choose(shape: Workload, cluster: Cluster, recipe: str | None = None, kernel: str = "auto",
           elem_bytes: int = 2, gpu: str | None = None) -> Choice:
    """The layout for one attention shape on a cluster, and why (an entry, or the cost model's prediction with
    the calibration of `gpu`, a device name)."""
    recipes = load_recipes(recipe)
    hit = find_entry(recipes, shape, cluster)
    where = f"{shape.tokens}+{shape.text_tokens} tokens, {shape.heads} heads x {shape.head_dim}, " \
            f"{cluster.machines} x {cluster.gpus_per_machine}" + \
            (f", {cluster.link} link" if cluster.machines > 1 else "")
    if hit is not None:
        source, e = hit
        timing = f", {e['ms']['median']:.3f} ms" if isinstance(e.get("ms"), dict) else ""
        runner = f", runner-up {e['runner_up']['layout']} +{100 * e['margin']:.1f}%" if "runner_up" in e else ""
        size = next((f"{k} {e[k]}" for k in ("resolution", "frames", "tokens") if k in e), "")
        why = (f"recipe {source.path}, entry {size} ({e.get('source', 'no source')}{timing}"
               f"{', ' + e['device'] if 'device' in e else ''}{runner}) for {where}")
        chosen_kernel = e.get("kernel", "auto") if kernel == "auto" else kernel
        return Choice(entry_layout(e, shape.heads), chosen_kernel, why)
    matching = [r for r in recipes if any((w := entry_workload(e, r.model)) is not None and w.heads == shape.heads
                                          and w.head_dim == shape.head_dim for e in r.entries)]
    calibration = next((r.calibration_for(gpu) for r in matching + recipes if r.calibration), None)
    best, *rest = ranked(shape, cluster, gpu_of(calibration), elem_bytes)
    runner = f", runner-up {rest[0].layout} {rest[0].layer_ms:.3f} ms" if rest else ""
    why = (f"cost model{' (calibrated)' if calibration else ''}: predicted {best.layer_ms:.3f} ms{runner}; no "
           f"recipe entry for {where}")
    world = cluster.machines * cluster.gpus_per_machine
    if cluster.machines == 1 and tokens_per_gpu(shape, world) < TORUS_MIN_TOKENS_PER_GPU:
        why += f"; {why_torus_off(shape, world)}"
    return Choice(best.layout, kernel, why)


def auto_layout(ctx: ParallelContext, q: Tensor, seq_lens: Sequence[int], joint_len: int) -> Choice:
    """method "auto"'s choice for one sp_attention shape: rank 0 decides, every rank follows; logged once. The
    context asks it once per shape (init_parallel hands it over as the context's chooser)."""
    config = ctx.config
    machines, gpus = ctx.branch_shape  # with CFG parallelism, one guidance branch's cluster
    shape = Workload("seen", sum(seq_lens), joint_len, q.shape[2], q.shape[3], 1, batch=q.shape[0])
    cluster = Cluster(machines, gpus, config.emulate_link or REAL_LINK, config.backend)
    decide = ctx.global_rank == 0
    with one_time("layout choice"):
        device = torch.cuda.get_device_name(q.device) if q.is_cuda else None
        box = [choose(shape, cluster, config.recipe, config.kernel, q.element_size(), device) if decide else None]
        # every branch runs the same shapes together, and with worlds given every world too (the process groups of
        # a layout's mesh are made by every rank of the job at once): one choice for all, bounded by timeout_s
        dist.broadcast_object_list(box, src=0, group=ctx.groups.world(config.timeout_s))
    if decide:
        logger.info("streamfusion auto: %s (%s)", box[0].layout, box[0].why)
    return box[0]


__all__ = ["Choice", "Cluster", "auto_layout", "choose", "find_entry", "gpu_of", "ranked"]
