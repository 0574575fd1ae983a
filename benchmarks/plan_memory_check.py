"""`plan --memory`'s estimate (models/memory.py) against the peaks measured on GPUs and kept in benchmarks/results/:
the one-GPU pipeline peaks of Qwen-Image, Flux.2-dev and Wan 2.2 A14B (`generate`, run.json's peak_memory_gib) and
Flux.1-dev's transformer step on 2 GPUs (`bench --level step`). CPU only (meta-device builds); prints a table and
writes the rows as JSON to --out. Run from the project root: python benchmarks/plan_memory_check.py --out DIR/x.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from streamfusion_diffusers.models.memory import GIB, estimate, pipeline_parts

RESULTS = Path(__file__).resolve().parent / "results"
PIPELINES = ("qwen-image", "flux2-dev", "wan2.2-t2v-a14b")
FLUX_STEP = RESULTS / "2026-11-22-h200x2" / "step-flux-dev-2048" / "results.json"


def rows() -> list[dict]:
    out = []
    for model in PIPELINES:
        record = RESULTS / "2026-11-24-h200-new-models" / f"{model}.run.json"
        run = json.loads(record.read_text())
        e = estimate(model, run["height"], run["width"], run["frames"] or 1, run["world_size"])
        out.append({"what": f"{model} pipeline, {e.size}, P = {run['world_size']}", "record": str(record.relative_to(
            RESULTS.parent.parent)), "measured_gib": round(run["peak_memory_gib"], 2), "planned_gib": round(e.peak, 2),
            "planned_by_part": {k: round(v, 2) for k, v in e.as_dict().items() if isinstance(v, float)}})
    measured = max(r["peak_gib"] for r in json.loads(FLUX_STEP.read_text())["rows"] if r["method"] == "ulysses")
    e = estimate("flux-dev", 2048, 2048, 1, 2)
    planned = pipeline_parts("flux-dev")["transformer"].total / GIB + e.activations + e.attention
    out.append({"what": "flux-dev transformer step, 2048x2048, P = 2 (ulysses)",
                "record": str(FLUX_STEP.relative_to(RESULTS.parent.parent)), "measured_gib": round(measured, 2),
                "planned_gib": round(planned, 2)})
    for row in out:
        row["planned_over_measured"] = round(row["planned_gib"] / row["measured_gib"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="plan_memory_check.json")
    args = parser.parse_args()
    table = rows()
    for row in table:
        print(f"{row['what']:<55} measured {row['measured_gib']:6.2f} GiB  planned {row['planned_gib']:6.2f} GiB  "
              f"x{row['planned_over_measured']:.3f}")
    Path(args.out).write_text(json.dumps({"command": "python benchmarks/plan_memory_check.py", "rows": table},
                                         indent=1) + "\n")


if __name__ == "__main__":
    main()
