"""One short table from the JSON files benchmarks/xdit_pipeline.py wrote (one per xfuser layout / emulated run).

    python benchmarks/xdit_summary.py "$OUT"

Real 1 x P: xfuser's USP at its best layout over the jobs, against ours at its best in that same job (one job,
same inputs); the issue's bar is ours never slower than xfuser's best by more than 2%. Emulated N x M: our Torus
against our best USP in one job. Exits non-zero if a check of our attention failed.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

BAR = 1.02  # ours / xfuser's best, at most


def best(rows: list[dict[str, Any]], pick: Any) -> dict[str, Any] | None:
    return min((r for r in rows if pick(r["variant"])), key=lambda r: r["ms"], default=None)


def main(folder: str) -> None:
    jobs = {p.stem.removeprefix("xdit_pipeline_"): json.loads(p.read_text())
            for p in sorted(Path(folder).glob("xdit_pipeline_*.json"))}
    failed = [(name, c) for name, job in jobs.items() for c in job["checks"]
              if not c["ok"] and c["variant"] != "xfuser-usp"]
    print(f"tiny checks: {sum(len(j['checks']) for j in jobs.values())} rows in {len(jobs)} jobs, "
          f"{len(failed)} of ours failed" + "".join(f"\n  FAIL {n}: {c}" for n, c in failed))
    print(f"\n{'1 x P':8} {'workload':18} {'xfuser best':>22} {'ours best (same job)':>26} {'ours/xf':>8} "
          f"{'auto/xf':>8} {'max err':>8} bar")
    real = {n: j for n, j in jobs.items() if not j.get("emulate_link")}
    for workload in dict.fromkeys(r["workload"] for j in real.values() for r in j["timings"]):
        runs = [(n, [r for r in j["timings"] if r["workload"] == workload]) for n, j in real.items()]
        runs = [(n, rows, best(rows, lambda v: v == "xfuser")) for n, rows in runs]
        runs = [x for x in runs if x[2] is not None]
        if not runs:
            continue
        name, rows, xf = min(runs, key=lambda x: x[2]["ms"])
        ours, auto = best(rows, lambda v: v != "xfuser"), best(rows, lambda v: v == "auto")
        ratio = ours["ms"] / xf["ms"]
        print(f"{'':8} {workload:18} {xf['ms']:9.1f} ({name:>10}) {ours['ms']:9.1f} ({ours['variant']:>14}) "
              f"{ratio:8.3f} {auto['ms'] / xf['ms'] if auto else float('nan'):8.3f} "
              f"{max(r['vs_first'] for r in rows):8.1e} {'PASS' if ratio <= BAR else 'FAIL'}")
    for name, job in jobs.items():
        if not job.get("emulate_link"):
            continue
        print(f"\n{name:30} {'workload':18} {'usp best':>22} {'torus':>9} {'torus x':>8} {'auto':>9} {'max err':>8}")
        for workload in dict.fromkeys(r["workload"] for r in job["timings"]):
            rows = [r for r in job["timings"] if r["workload"] == workload]
            usp, torus = best(rows, lambda v: v.startswith("usp")), best(rows, lambda v: v.startswith("torus"))
            auto = best(rows, lambda v: v == "auto")
            if usp is None or torus is None:
                continue
            print(f"{'':30} {workload:18} {usp['ms']:9.1f} ({usp['variant']:>10}) {torus['ms']:9.1f} "
                  f"{usp['ms'] / torus['ms']:8.3f} {auto['ms'] if auto else float('nan'):9.1f} "
                  f"{max(r['vs_first'] for r in rows):8.1e}")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
