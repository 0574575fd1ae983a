"""Which replica split to serve with: R groups of P / R ranks (`streamfusion serve --replicas R`), each running
whole requests one at a time behind one queue, on one machine or N (a group of whole machines, its attention
across them the cost model's, Torus among the layouts; or an equal share of every machine: `replica_shape`); per split, the predicted latency of one request and the images
(videos) per minute when every group is kept busy.

What is predicted, and from what:
- One denoising step of a group of P' = P / R ranks, in two parts. The attention (with its transfers) is the
  cost model's (costmodel.py, the calibrated `Gpu` of the model's recipe): the fastest layout `method="auto"` would
  rank for P' ranks, per block, times the transformer calls per step (2 with classifier-free guidance). The cost
  model has no term for the rest of the step (projections, MLP, norms, modulation, host side): that part is taken
  from a recorded one-GPU step (RECORDS: the step minus the cost model's attention at P' = 1) and scaled by the
  tokens a rank holds (its image tokens / P' plus the joint text tokens every rank keeps), with Amdahl's serial
  share `sigma` that does not shrink over ranks, fitted where a 2-GPU record exists (flux-dev 2048, Wan 2.2
  TI2V-5B 49 f, Qwen-Image 1328) and their mean elsewhere.
- Text encoding and the VAE decode of one request: the records' (decode scaled by output pixels), the same at any
  P' (the decode's band split over ranks is not modelled: the 2-GPU records show 1.00x for Flux 2048, 1.80x for
  Wan 49 f, so 1 x P's latency is over-predicted by at most the decode's share).
- Memory: the per-GPU peak for P' ranks, whole and sharded weights, that the caller passes (`plan --serve`:
  models/memory.py's, which sits a floor above this one); a split neither fits is listed with the reason.
  Sharded weights' all-gathers per step are not in the step time (not measured yet).
Not in the latency: the HTTP round trip and the image's PNG / video's mp4 encoding on rank 0 (serve_load.py
measures them). All records are whole generations on one NVIDIA H200 (times on other GPUs scale by their speed).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from ..core.config import divisors
from ..models.configs import MODELS
from .choose import Cluster, ranked
from .costmodel import Gpu
from .workloads import MODELS as WORKLOADS, Workload

RESULTS = "benchmarks/results"


@dataclass(frozen=True)
class Record:
    """One recorded warm generation (seconds, medians): per denoising step, text encoding, decode; at `ranks`."""

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


RECORDS = (
    Record("flux-dev", 1, 2048, 2048, 1, 1, 4.254 / 5, 0.032, 0.403, "2026-11-23-h200x2/e2e-flux/results.json",
           "one-gpu"),
    Record("flux-dev", 1, 2048, 2048, 2, 1, 2.354 / 5, 0.042, 0.412, "2026-11-23-h200x2/e2e-flux/results.json", "ours"),
    Record("wan2.2-ti2v-5b", 49, 704, 1280, 1, 2, 3.076 / 4, 0.096, 2.358,
           "2026-11-24-h200x2-step-new-models/wan-e2e.results.json", "one-gpu"),
    Record("wan2.2-ti2v-5b", 49, 704, 1280, 2, 2, 1.702 / 4, 0.101, 1.311,
           "2026-11-24-h200x2-step-new-models/wan-e2e.results.json", "ours"),
    Record("qwen-image", 1, 1328, 1328, 1, 1, 0.597 / 2, 0.023, 0.118,
           "2026-11-24-h200-e2e-new-models/results.json", "one-gpu"),
    Record("qwen-image", 1, 1328, 1328, 2, 1, 0.2004, 0.0, 0.0,
           "2026-11-24-h200x2-step-new-models/wan-qwen1328.results.json", "auto",
           "bench --level step: the transformer step alone (no text, no decode; only its step is used)"),
    Record("flux2-dev", 1, 1024, 1024, 1, 1, 1.085 / 2, 0.0, 0.088,
           "2026-11-24-h200-e2e-new-models/results.json", "one-gpu",
           "its prompt was encoded at build (random weights): the 24B encoder's time per request is not in it"),
    Record("wan2.2-t2v-a14b", 17, 480, 832, 1, 2, 1.04, 0.50, 0.64,
           "2026-11-24-h200-new-models/wan2.2-t2v-a14b.run.json", "step 2",
           "one generate run: its text encoding and decode were the first (cold) calls"),
)


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
    """The model's one-GPU record and its 2-GPU one (None where not recorded)."""
    own = [r for r in RECORDS if r.model == model]
    if not own:
        covered = sorted({r.model for r in RECORDS})
        raise ValueError(f"plan --serve needs a recorded generation of {model}; it has records of "
                         f"{', '.join(covered)}")
    return next(r for r in own if r.ranks == 1), next((r for r in own if r.ranks == 2), None)


def workload_of(model: str, frames: int, height: int, width: int) -> Workload:
    return WORKLOADS[model](frames, height, width) if MODELS[model].video else WORKLOADS[model](width, height)


def replica_shape(machines: int, per_machine: int, replicas: int) -> tuple[int, int]:
    """(machines, processes per machine) of one of `replicas` groups: whole machines each where they divide,
    else an equal share of every machine's processes."""
    if machines % replicas == 0:
        return machines // replicas, per_machine
    if replicas % machines == 0 and per_machine % (replicas // machines) == 0:
        return 1, per_machine // (replicas // machines)
    raise ValueError(f"--replicas {replicas} does not split {machines} machine(s) x {per_machine} process(es) into "
                     f"equal groups: use a divisor of {machines * per_machine}")


def attention_s(w: Workload, ranks: int, gpu: Gpu, machines: int = 1) -> tuple[float, str]:
    """The cost model's attention time of one transformer call on `machines` machines of ranks / machines GPUs,
    fastest layout."""
    best = ranked(w, Cluster(machines, ranks // machines), gpu)[0]
    return w.blocks * best.layer_ms / 1e3, best.layout.label


def _share(w: Workload, ranks: int) -> float:
    """Tokens one rank holds at `ranks`, over those it holds alone: image tokens split, joint text kept whole."""
    return (w.tokens / ranks + w.text_tokens) / (w.tokens + w.text_tokens)


def _rest(model: str, gpu: Gpu) -> tuple[float, float]:
    """(the non-attention part of the one-GPU record's step, in seconds; its serial share sigma)."""
    one, two = records_of(model)
    calls = one.calls
    w1 = workload_of(model, one.frames, one.height, one.width)
    rest = one.step_s - calls * attention_s(w1, 1, gpu)[0]
    if two is None:
        fitted = [_rest(m, gpu)[1] for m in sorted({r.model for r in RECORDS if r.ranks == 2})]
        return rest, sum(fitted) / len(fitted)
    shrink = (two.step_s - calls * attention_s(w1, 2, gpu)[0]) / rest
    return rest, min(max((shrink - _share(w1, 2)) / (1 - _share(w1, 2)), 0.0), 1.0)


def step_s(model: str, frames: int, height: int, width: int, ranks: int, gpu: Gpu,
           machines: int = 1) -> tuple[float, str]:
    """Predicted seconds of one denoising step on a group of `ranks` GPUs over `machines` machines, and its
    layout."""
    one, _ = records_of(model)
    rest, sigma = _rest(model, gpu)
    w, w1 = workload_of(model, frames, height, width), workload_of(model, one.frames, one.height, one.width)
    attention, layout = attention_s(w, ranks, gpu, machines)
    tokens = (w.tokens + w.text_tokens) / (w1.tokens + w1.text_tokens)
    return one.calls * attention + rest * tokens * (sigma + (1 - sigma) * _share(w, ranks)), layout


def plan_replicas(model: str, frames: int, height: int, width: int, gpus: int, steps: int, gpu: Gpu,
                  peaks: Callable[[int], tuple[float, float]], room_gib: float, machines: int = 1) -> list[Split]:
    """Every split R x P/R of `machines` machines of `gpus` GPUs that `serve --replicas R` can make, the largest
    group first. peaks(P'): one GPU's peak GiB at P' ranks, whole and sharded weights (models/memory.py's);
    room_gib: what a GPU has for it."""
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
        step, layout = step_s(model, frames, height, width, ranks, gpu, spans)
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
