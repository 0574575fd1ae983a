"""Regenerating a recipe folder (the packaged one): cost-model entries where nothing was measured, and
`streamfusion tune`'s measured entries merged in from device runs.

The packaged recipes are built in two steps, both through `streamfusion tune`:
  tune --from-cost-model --shapes 1x2,1x8,2x8,2x1:p4de,... --out streamfusion_diffusers/choice/recipes
  tune --merge-from <device run's recipes folder> --out streamfusion_diffusers/choice/recipes
The first writes the cost model's choice for every shape (`source: cost model`), never over a measured entry;
the second merges measured entries and measurements.json in, refits the calibration of each GPU kind the new
records were measured on (the others' are kept) and predicts the remaining cost-model entries again with the
first kind's, so that nothing in the folder is predicted by a model older than the measurements beside it.
"""
from __future__ import annotations

import datetime
from pathlib import Path

from ..core.links import parse_link
from .calibrate import fit
from .choose import REAL_LINK, Cluster, entry_workload, gpu_of, ranked
from .predictions import BenchReader, load_records
from .recipe import calibration_for, gpu_kind, load_recipe
from .store import layout_fields, write_recipe, write_records
from .workloads import Workload


def parse_shapes(text: str, default_link: str) -> list[tuple[int, int, str]]:
    """'1x2,2x8,2x1:p4de,4x1:25:10' -> (machines, gpus per machine, link); the link defaults to --emulate-link
    (or "real"). One-machine shapes have no inter-machine link."""
    shapes = []
    for spec in (s.strip() for s in text.split(",") if s.strip()):
        shape, _, link = spec.partition(":")
        try:
            n, m = (int(x) for x in shape.split("x"))
        except ValueError:
            raise ValueError(f"shape {spec!r} is not like 2x8 or 2x1:p4de") from None
        link = link or default_link
        if link != REAL_LINK:
            parse_link(link)
        shapes.append((n, m, REAL_LINK if n == 1 else link))
    return shapes


def predicted_entry(base: dict, w: Workload, cluster: Cluster, calibration: dict | None, kernel: str,
                    elem_bytes: int = 2) -> dict:
    """A `source: cost model` entry: `base` (model and size fields) with the cost model's fastest layout."""
    best, *rest = ranked(w, cluster, gpu_of(calibration), elem_bytes)
    entry = {**base, "machines": cluster.machines, "gpus_per_machine": cluster.gpus_per_machine,
             "link": cluster.link, **layout_fields(best.layout), "backend": cluster.backend, "kernel": kernel,
             "predicted_ms": round(best.layer_ms, 4)}
    if rest:
        entry["runner_up"] = {"layout": rest[0].layout.label, "predicted_ms": round(rest[0].layer_ms, 4)}
        entry["margin"] = round(rest[0].layer_ms / best.layer_ms - 1, 4)
    return {**entry, "source": "cost model", "date": datetime.date.today().isoformat()}


def from_cost_model(workloads: list[tuple[str, Workload, dict]], shapes: list[tuple[int, int, str]], out: Path,
                    backend: str, kernel: str, elem_bytes: int) -> int:
    """Cost-model entries for every (model, workload, size fields) on every shape, merged into <out>/<model>.yaml
    with the calibration already in its header (measured entries kept)."""
    by_model: dict[str, list[dict]] = {}
    for model, w, base in workloads:
        path = out / f"{model}.yaml"
        calibration = load_recipe(str(path)).calibration_for() if path.is_file() else None
        by_model.setdefault(model, []).extend(
            predicted_entry(base, w, Cluster(n, m, link, backend), calibration, kernel, elem_bytes)
            for n, m, link in shapes)
    for model, entries in by_model.items():
        print(f"wrote {write_recipe(out / f'{model}.yaml', model, entries)} ({len(entries)} cost-model entries)")
    return 0


SIZE_FIELDS = ("model", "resolution", "height", "frames", "width", "tokens", "text_tokens", "heads", "head_dim")


def repredict(path: Path, calibrations: dict | None) -> int:
    """Predict the cost-model entries of one recipe file again with the first of its calibrations once
    `calibrations` (per GPU kind) are merged in; returns how many."""
    recipe = load_recipe(str(path))
    calibration = calibration_for({**(recipe.calibration or {}), **(calibrations or {})})
    fresh = []
    for e in recipe.entries:
        w = entry_workload(e, recipe.model)
        if e.get("source") == "cost model" and w is not None:
            cluster = Cluster(e["machines"], e["gpus_per_machine"], e.get("link", REAL_LINK), e.get("backend", "torch"))
            base = {k: e[k] for k in SIZE_FIELDS if k in e}
            fresh.append(predicted_entry(base, w, cluster, calibration, e.get("kernel", "auto")))
    write_recipe(path, recipe.model, fresh, calibrations)
    return len(fresh)


def merge_from(sources: list[str], out: Path, read_bench: BenchReader | None = None) -> int:
    """Merge tune's outputs (folders with <model>.yaml and measurements.json) into the recipes under `out`;
    bench's output folders (results.json, read by `read_bench`) add their layer timings to the records the
    calibration is fitted on."""
    records, measured = [], {}
    for source in map(Path, sources):
        if not source.is_dir():
            raise ValueError(f"--merge-from {source}: not a folder; give the --out folder of a tune run")
        found = sorted(source.glob("*.yaml"))
        timed = [source / name for name in ("measurements.json", "results.json") if (source / name).is_file()]
        if not found and not timed:
            raise ValueError(f"--merge-from {source}: neither <model>.yaml nor measurements.json / results.json "
                             f"in it; give the --out folder of a tune (or bench) run")
        for path in found:
            recipe = load_recipe(str(path))
            measured.setdefault(recipe.model, []).extend(e for e in recipe.entries if e.get("source") == "measured")
        records += load_records([str(p) for p in timed], read_bench)
    every = write_records(out / "measurements.json", records) if records else []
    calibrations = {}
    for kind in dict.fromkeys(gpu_kind(r["device"]) for r in records):  # the kinds the new records came from
        calibrations[kind] = fit([r for r in every if gpu_kind(r["device"]) == kind])
        print(f"calibration of {kind} fitted on {calibrations[kind].get('fitted_on', 'no layouts')}: rms error "
              f"{calibrations[kind].get('rms_error_before', 0):.1%} -> {calibrations[kind].get('rms_error', 0):.1%}")
    for model, entries in measured.items():
        write_recipe(out / f"{model}.yaml", model, entries, calibrations)
        print(f"merged {len(entries)} measured entries into {out / f'{model}.yaml'}")
    for path in sorted(out.glob("*.yaml")):
        n = repredict(path, calibrations)
        print(f"predicted {n} cost-model entries of {path} again")
    return 0
