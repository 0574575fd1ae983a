"""Recipe entries and tune's measurement records on disk: build them, merge them into what is there, write.

An entry is keyed by what the layout depends on: cluster shape, link (between machines only), transport and
attention shape (heads, head size, tokens). Merging replaces the entries of the same key and keeps every
other, and never lets a cost-model entry replace a measured one.
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from ..core.config import Layout
from ..core.links import parse_link
from .choose import REAL_LINK, entry_workload, transport_name
from .recipe import load_recipe

HEADER = ("# {model}: the layout per cluster shape, link and size; written by `streamfusion tune` (each entry says\n"
          "# whether it was measured or predicted by the cost model). `method=\"auto\"` reads it.\n")


def layout_fields(lay: Layout) -> dict:
    out = {"method": lay.method, "ulysses": lay.ulysses, "ring": lay.ring}
    return {**out, "torus": lay.torus} if lay.method == "torus" else out


def link_name(spec: str | None) -> str:
    """How an entry names its link: a preset's name, a 'GBPS:US' spec, or "real" (not emulated)."""
    if spec is None:
        return REAL_LINK
    parse_link(spec)
    return spec


def _key(entry: dict, model: str) -> tuple:
    w = entry_workload(entry, model)
    shape = (w.tokens, w.text_tokens, w.heads, w.head_dim) if w else tuple(sorted(entry.items()))
    link = entry.get("link") if entry["machines"] > 1 else None
    return (entry["machines"], entry["gpus_per_machine"], link, transport_name(entry.get("backend", "torch")), shape)


def merge(old: list[dict], new: list[dict], model: str) -> list[dict]:
    """Old entries with new ones in their place (same key); a predicted entry never replaces a measured one."""
    merged = {_key(e, model): e for e in old}
    for e in new:
        key = _key(e, model)
        if e.get("source") == "cost model" and merged.get(key, {}).get("source") == "measured":
            continue
        merged[key] = e
    size = ("resolution", "frames", "tokens")
    return sorted(merged.values(), key=lambda e: (e["machines"], e["gpus_per_machine"], str(e.get("link")),
                                                  [e.get(k, 0) for k in size]))


def write_recipe(path: Path, model: str, entries: list[dict], calibration: dict | None = None) -> Path:
    """Merge `entries` into the recipe at `path` (created if absent), keeping its other entries, and the
    calibrations per GPU kind in `calibration` into its header, keeping those of other kinds."""
    old_entries, old_calibration = [], None
    if path.is_file():
        old = load_recipe(str(path))
        if old.model != model:
            raise ValueError(f"{path} holds model {old.model!r}, not {model!r}: write to another folder")
        old_entries, old_calibration = list(old.entries), old.calibration
    doc = {"model": model}
    if calibration or old_calibration:
        doc["calibration"] = {**(old_calibration or {}), **(calibration or {})}
    doc["entries"] = merge(old_entries, entries, model)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write(HEADER.format(model=model))
        yaml.safe_dump(doc, f, sort_keys=False, default_flow_style=None, width=140)
    return path


def record_key(r: dict) -> tuple:
    return (r["device"], r["kind"], r["machines"], r["gpus_per_machine"], r["link"], r["backend"], r["tokens"],
            r["heads"], r["head_dim"], r["method"], r["ulysses"], r["ring"], r["torus"])


def write_records(path: Path, records: list[dict]) -> list[dict]:
    """Merge this run's measured-vs-predicted records into the JSON file at `path`; returns all of them."""
    old = json.loads(path.read_text())["records"] if path.is_file() else []
    merged = {record_key(r): r for r in old + records}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"records": list(merged.values())}, indent=1) + "\n")
    return list(merged.values())


GENERATIONS = "generations.json"  # in the packaged recipes folder: what `plan --serve`'s step model is fitted on


def load_generations() -> dict:
    """The recorded generations and steps of `plan --serve`'s step model, and the graph path's fixed costs."""
    from .recipe import PACKAGED

    return json.loads((PACKAGED / GENERATIONS).read_text())
