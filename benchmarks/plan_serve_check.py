"""`plan --serve`'s step prediction (choice/replicas.py) against recorded steps it was not fitted on, each read from
its file under benchmarks/results/. Eager: Flux.1-dev 2048 on 2 x H200 (ours, a whole generation's denoise over its steps), 1024 on one H200 (our processors), Qwen-Image 1024 and 2048
on 2 x H200 (the best of ours), Wan 2.2 TI2V-5B 121 f on 2 x H200 (one transformer call; a step makes two under
CFG) and 17 f on one H200 (a whole generation's denoise over its steps). Replayed from CUDA graphs (generate's
default): Flux.1-dev 1024 at P = 1 on one H100 and at P = 2 and 4 on H200s (steady steps). Each row says whether
the model predicts the step waits on the host (eager, the host's time per block longer than the GPU's work) or on
the device. CPU only; prints a table and writes the rows as JSON to --out. Run from the project root:
python benchmarks/plan_serve_check.py --out DIR/x.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from streamfusion_diffusers.choice.choose import gpu_of
from streamfusion_diffusers.choice.recipe import load_recipe
from streamfusion_diffusers.choice.replicas import device_s, records_of, step_s

RESULTS = Path(__file__).resolve().parent / "results"
QWEN_P2 = "2026-11-24-h200x2-step-new-models/qwen1024-2048.results.json"
WAN_P2 = "2026-11-24-h200x2-step-new-models/wan-qwen1328.results.json"
H100_P1 = "2026-11-26-h100x4-default-serve-s33/default_path.json"
H200_P4 = "2026-11-26-h200x4-default-path-s33/default_path.json"


def _best_of_ours(record: str, workload: str) -> float:
    """bench --level step: the fastest of our methods (auto included) on that workload, seconds per call."""
    rows = json.loads((RESULTS / record).read_text())["rows"]
    return min(r["ms"] for r in rows if r["workload"] == workload and r["method"] != "diffusers-cp") / 1e3


def _compiled_eager(record: str) -> float:
    """compile_bench: the eager step of our processors, seconds."""
    return json.loads((RESULTS / record).read_text())["modes"]["eager"]["ms"]["ours"]["median"] / 1e3


def _denoise_per_step(record: str, workload: str, system: str = "one-gpu") -> float:
    """bench --level e2e: a system's denoise over its steps, seconds per step."""
    data = json.loads((RESULTS / record).read_text())
    row = next(r for r in data["rows"] if r["workload"] == workload and r["system"] == system)
    return row["phases"]["denoising"]["median"] / data["setup"]["steps"]


def _steady(record: str, run: str) -> float:
    """benchmarks/default_path_gpu.sh: a run's steady step (steps 3 onward, after the eager first and the capture)."""
    return statistics.median(json.loads((RESULTS / record).read_text())[run]["steps_s"][2:])


# (model, frames, height, width, ranks, transformer calls in the record's figure, CUDA graphs, record, its figure: s)
CHECKS = (
    ("flux-dev", 1, 2048, 2048, 2, 1, False, "2026-11-23-h200x2/e2e-flux/results.json",
     lambda r: _denoise_per_step(r, "flux-dev 2048x2048", "ours")),
    ("flux-dev", 1, 1024, 1024, 1, 1, False, "2026-11-24-h200-compile/compile_bench_flux-dev_1024.json",
     lambda r: _compiled_eager(r)),
    ("qwen-image", 1, 1024, 1024, 2, 1, False, QWEN_P2, lambda r: _best_of_ours(r, "qwen-image 1024x1024")),
    ("qwen-image", 1, 2048, 2048, 2, 1, False, QWEN_P2, lambda r: _best_of_ours(r, "qwen-image 2048x2048")),
    ("wan2.2-ti2v-5b", 121, 704, 1280, 2, 1, False, WAN_P2,
     lambda r: _best_of_ours(r, "wan2.2-ti2v-5b 121f 1280x704")),
    ("wan2.2-ti2v-5b", 17, 704, 1280, 1, 2, False, "2026-11-24-h200-e2e-new-models/results.json",
     lambda r: _denoise_per_step(r, "wan2.2-ti2v-5b 17f 1280x704")),
    ("flux-dev", 1, 1024, 1024, 1, 1, True, H100_P1, lambda r: _steady(r, "p1")),
    ("flux-dev", 1, 1024, 1024, 2, 1, True, H200_P4, lambda r: _steady(r, "p2")),
    ("flux-dev", 1, 1024, 1024, 4, 1, True, H200_P4, lambda r: _steady(r, "p4")),
)


def rows() -> list[dict]:
    gpu = gpu_of(load_recipe("flux-dev").calibration_for())
    out = []
    for model, frames, height, width, ranks, calls, graph, record, figure in CHECKS:
        predicted, layout = step_s(model, frames, height, width, ranks, gpu, graph)
        device, _ = device_s(model, frames, height, width, ranks, gpu)
        per_call = predicted * calls / records_of(model)[0].calls  # as many transformer calls as the record's
        measured = figure(record)
        size = f"{frames} x {height} x {width}" if frames > 1 else f"{height} x {width}"
        out.append({"what": f"{model} {size}, P = {ranks}, {'graph' if graph else 'eager'}",
                    "record": f"benchmarks/results/{record}", "bound": "device" if predicted <= device else "host",
                    "calls": calls, "measured_s": round(measured, 4), "predicted_s": round(per_call, 4),
                    "layout": layout,
                    "predicted_over_measured": round(per_call / measured, 3)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="plan_serve_check.json")
    args = parser.parse_args()
    table = rows()
    for row in table:
        print(f"{row['what']:<45} measured {row['measured_s']:6.3f} s  predicted {row['predicted_s']:6.3f} s "
              f"({row['layout']}, {row['bound']}-bound)  x{row['predicted_over_measured']:.3f}")
    Path(args.out).write_text(json.dumps({"command": "python benchmarks/plan_serve_check.py", "rows": table},
                                         indent=1) + "\n")


if __name__ == "__main__":
    main()
