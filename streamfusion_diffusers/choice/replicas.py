"""Which replica split to serve with: R groups of P / R ranks (`streamfusion serve --replicas R`), each running
whole requests one at a time behind one queue, on one machine or N (a group of whole machines, its attention
across them the cost model's, Torus among the layouts; or an equal share of every machine: `replica_shape`); per split, the predicted latency of one request and the images
(videos) per minute when every group is kept busy.

What is predicted, and from what (the records: choice/recipes/generations.json, each read from its file):
- The GPU's work in one denoising step of a group of P' = P / R ranks, in two parts. The attention (with its
  transfers) is the cost model's (costmodel.py, the calibrated `Gpu` of the model's recipe, less the fixed costs
  per kernel, stage and call, which were fitted on eager timings and are the host's) of the layout
  `method="auto"` runs for P' ranks (a recipe entry, else the cost model's fastest with those costs, as choose.py
  ranks them at run time), per block, times the transformer calls per step (2 with classifier-free guidance).
  The rest of the step (projections, MLP, norms, modulation) is a recorded one-GPU step, which waits on the GPU,
  less that attention, scaled by the tokens a rank holds (its image tokens / P' plus the joint text
  tokens every rank keeps), with Amdahl's serial share `sigma` fitted where a record of several GPUs waits on the
  GPU too (a graphed one first: flux-dev 1024 at P = 4; else at P = 2: Wan 2.2 TI2V-5B 49 f), their mean elsewhere.
- The host. Replayed from CUDA graphs (serve's default on GPUs) the host issues one replay per call, while the
  GPU still runs the step before (nothing synchronizes per call): the step is the GPU's work. Eager (`--no-cuda-graph`, `--cache`,
  `--shard-weights`), the host issues every kernel of every block while the GPU runs the earlier ones: the step
  is the longer of the GPU's work and the host's, whose time per block is fitted on the eager records that
  waited on the host (per model, their mean elsewhere).
- Text encoding and the VAE decode of one request: the records' warm figures (decode scaled by output pixels),
  the same at any P' (the decode's band split over ranks is not modelled, and it speeds some models' decode and
  not others', so 1 x P's latency is over-predicted by at most the decode's share).
- Memory: the per-GPU peak for P' ranks, whole and sharded weights, that the caller passes (`plan --serve`:
  models/memory.py's, which sits a floor above this one); a split neither fits is listed with the reason.
  Sharded weights' all-gathers per step are not in the step time (no record holds them).
Not in the latency: the HTTP round trip and the image's PNG / video's mp4 encoding on rank 0 (serve_load.py
measures them). The records are H200 runs, and H100 ones where a record says so (their steps at P = 1 agree
within the run-to-run spread); host times depend on the host and the code that ran.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import cache

from ..core.config import divisors
from ..models.configs import MODELS
from .choose import Cluster, entry_layout, find_entry, ranked
from .calibrate import host_per_block
from .costmodel import Gpu, predict
from .recipe import Recipe, load_recipes
from .store import load_generations
from .workloads import MODELS as WORKLOADS, Workload

RESULTS = "benchmarks/results"


@dataclass(frozen=True)
class Record:
    """One recorded warm generation or step (seconds, medians): per denoising step, text encoding, decode; at
    `ranks`, on the eager path or replayed from a CUDA graph, its step set by the device's work or the host's."""

    model: str
    frames: int
    height: int
    width: int
    ranks: int
    calls: int  # transformer calls per step (2: classifier-free guidance at the model's defaults)
    step_s: float
    text_s: float
    decode_s: float
    record: str  # the file under benchmarks/results/ it comes from
    row: str  # the row (bench's `system`, or the run) within it
    note: str = ""  # what the record lacks, said beside every prediction made from it
    path: str = "eager"  # "eager" or "graph"
    bound: str = "device"  # "device" or "host": what the step waited on


_STORE = load_generations()
RECORDS = tuple(Record(**r) for r in _STORE["records"])


@dataclass(frozen=True)
class Split:
    """One replica split R x P' and what it is predicted to give; `excluded` says why it cannot serve."""

    replicas: int
    ranks: int
    layout: str
    step_s: float
    text_s: float
    decode_s: float
    latency_s: float
    per_minute: float
    peak_whole_gib: float
    peak_sharded_gib: float
    weights: str  # "whole", "sharded" (only sharded weights fit) or "-" (neither)
    excluded: str | None = None
    machines: int = 1  # machines one group spans

    def as_dict(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


def records_of(model: str) -> tuple[Record, Record | None]:
    """The model's one-GPU record and the one of several GPUs its serial share is fitted on (None where none waits
    on the device): a graphed one first, whose step is the device's work alone."""
    own = [r for r in RECORDS if r.model == model]
    if not own:
        covered = sorted({r.model for r in RECORDS})
        raise ValueError(f"plan --serve needs a recorded generation of {model}; it has records of "
                         f"{', '.join(covered)}")
    device = [r for r in own if r.bound == "device"]
    several = sorted((r for r in device if r.ranks > 1), key=lambda r: (r.path != "graph", r.ranks))
    return next(r for r in device if r.ranks == 1), next(iter(several), None)


def workload_of(model: str, frames: int, height: int, width: int) -> Workload:
    return WORKLOADS[model](frames, height, width) if MODELS[model].video else WORKLOADS[model](width, height)


def graph_gpu(gpu: Gpu) -> Gpu:
    """The GPU as the device sees it: without the host's fixed costs per kernel, stage and call (the graph path's)."""
    fixed = {k: v for k, v in _STORE["graph_path"].items() if k != "why"}
    return replace(gpu, **fixed)


def replica_shape(machines: int, per_machine: int, replicas: int) -> tuple[int, int]:
    """(machines, processes per machine) of one of `replicas` groups: whole machines each where they divide,
    else an equal share of every machine's processes."""
    if machines % replicas == 0:
        return machines // replicas, per_machine
    if replicas % machines == 0 and per_machine % (replicas // machines) == 0:
        return 1, per_machine // (replicas // machines)
    raise ValueError(f"--replicas {replicas} does not split {machines} machine(s) x {per_machine} process(es) into "
                     f"equal groups: use a divisor of {machines * per_machine}")


@cache  # read once: a plan predicts every split and record through attention_s
def _recipes() -> list[Recipe]:
    """The recipes `method="auto"` reads (the user's, then the packaged ones)."""
    return load_recipes(None)


def attention_s(w: Workload, ranks: int, gpu: Gpu, machines: int = 1) -> tuple[float, str]:
    """The cost model's device time of one transformer call's attention on `machines` machines of ranks / machines
    GPUs, at the layout `method="auto"` runs there (ranked with the host's costs, as at run time), replayed."""
    cluster = Cluster(machines, ranks // machines)
    hit = find_entry(_recipes(), w, cluster)
    layout = entry_layout(hit[1], w.heads) if hit is not None else ranked(w, cluster, gpu)[0].layout
    return w.blocks * predict(layout, w, cluster.inter, graph_gpu(gpu)).layer_ms / 1e3, layout.label


def _share(w: Workload, ranks: int) -> float:
    """Tokens one rank holds at `ranks`, over those it holds alone: image tokens split, joint text kept whole."""
    return (w.tokens / ranks + w.text_tokens) / (w.tokens + w.text_tokens)


def _rest(model: str, gpu: Gpu) -> tuple[float, float]:
    """(the non-attention part of the one-GPU record's step, in seconds; its serial share sigma)."""
    one, many = records_of(model)
    w1 = workload_of(model, one.frames, one.height, one.width)
    rest = one.step_s - one.calls * attention_s(w1, 1, gpu)[0]
    if many is None:
        fitted = [_rest(m, gpu)[1] for m in sorted({r.model for r in RECORDS if r.ranks > 1 and r.bound == "device"})]
        return rest, sum(fitted) / len(fitted)
    w = workload_of(model, many.frames, many.height, many.width)
    tokens = (w.tokens + w.text_tokens) / (w1.tokens + w1.text_tokens)
    shrink = (many.step_s - many.calls * attention_s(w, many.ranks, gpu)[0]) / (rest * tokens)
    share = _share(w, many.ranks)
    return rest, min(max((shrink - share) / (1 - share), 0.0), 1.0)


def device_s(model: str, frames: int, height: int, width: int, ranks: int, gpu: Gpu,
             machines: int = 1) -> tuple[float, str]:
    """Seconds of the GPU's work in one denoising step on a group of `ranks` GPUs over `machines` machines, and its
    layout."""
    one, _ = records_of(model)
    rest, sigma = _rest(model, gpu)
    w, w1 = workload_of(model, frames, height, width), workload_of(model, one.frames, one.height, one.width)
    attention, layout = attention_s(w, ranks, gpu, machines)
    tokens = (w.tokens + w.text_tokens) / (w1.tokens + w1.text_tokens)
    return one.calls * attention + rest * tokens * (sigma + (1 - sigma) * _share(w, ranks)), layout


def _host_per_block() -> dict[str, float]:
    """Host seconds per block on the eager path, per model, fitted on the records that waited on the host."""
    blocks = {r.model: workload_of(r.model, r.frames, r.height, r.width).blocks for r in RECORDS}
    return host_per_block(list(RECORDS), blocks)


def host_s(model: str) -> float:
    """Seconds the host takes to issue one eager step (every block of every call): the model's fitted figure, else
    the mean over the models that have one, per block."""
    per_block = _host_per_block()
    one, _ = records_of(model)
    blocks = workload_of(model, one.frames, one.height, one.width).blocks
    each = per_block.get(model, sum(per_block.values()) / len(per_block))
    return one.calls * blocks * each


def step_s(model: str, frames: int, height: int, width: int, ranks: int, gpu: Gpu,
           graph: bool = True, machines: int = 1) -> tuple[float, str]:
    """Predicted seconds of one denoising step on a group of `ranks` GPUs over `machines` machines, and its layout. Replayed
    from a CUDA graph (`graph`), the host issues one replay per call, ahead of the GPU, and the step is the device's
    work; eager, the host issues every kernel while the GPU runs the earlier ones: the longer of the two."""
    device, layout = device_s(model, frames, height, width, ranks, gpu, machines)
    return (device if graph else max(device, host_s(model))), layout


def plan_replicas(model: str, frames: int, height: int, width: int, gpus: int, steps: int, gpu: Gpu,
                  peaks: Callable[[int], tuple[float, float]], room_gib: float, graph: bool = True,
                  machines: int = 1) -> list[Split]:
    """Every split R x P/R of `machines` machines of `gpus` GPUs that `serve --replicas R` can make, the largest
    group first. peaks(P'): one GPU's peak GiB at P' ranks, whole and sharded weights (models/memory.py's);
    room_gib: what a GPU has for it; graph: whether the steps replay from CUDA graphs (serve's default on GPUs) or
    run eager."""
    if gpus < 1 or steps < 1:
        raise ValueError(f"plan --serve needs at least 1 GPU and 1 step; got {gpus} GPU(s), {steps} step(s)")
    one, _ = records_of(model)
    pixels = frames * height * width / (one.frames * one.height * one.width)
    splits = []
    for ranks in sorted(divisors(machines * gpus), reverse=True):
        replicas = machines * gpus // ranks
        try:
            spans = replica_shape(machines, gpus, replicas)[0]
        except ValueError:  # no equal groups of this size
            continue
        whole, sharded = peaks(ranks)
        step, layout = step_s(model, frames, height, width, ranks, gpu, graph, spans)
        latency = one.text_s + steps * step + one.decode_s * pixels
        fits = "whole" if whole <= room_gib else "sharded" if sharded <= room_gib else "-"
        why = None if fits != "-" else (f"{replicas} x {ranks}: needs {whole:.1f} GiB per GPU whole, {sharded:.1f} "
                                        f"sharded; a GPU has {room_gib:.1f} for it")
        splits.append(Split(replicas, ranks, layout, step, one.text_s, one.decode_s * pixels, latency,
                            replicas * 60 / latency, whole, sharded, fits, why, spans))
    return splits


def recommend(splits: list[Split]) -> tuple[Split, Split]:
    """(the lowest latency, the most images per minute) among the splits that fit."""
    fitting = [s for s in splits if s.excluded is None]
    if not fitting:
        raise ValueError(f"no split fits the GPU's memory: {splits[0].excluded}; use larger GPUs or more of them")
    return (min(fitting, key=lambda s: (s.latency_s, s.replicas)),
            max(fitting, key=lambda s: (s.per_minute, -s.replicas)))


def record_path(record: Record) -> str:
    return f"{RESULTS}/{record.record}"


__all__ = ["RECORDS", "Record", "Split", "plan_replicas", "recommend", "record_path", "records_of", "replica_shape",
           "step_s"]
