"""Issue 35 item 1: `streamfusion serve --replicas R` measured for every R dividing this machine's P GPUs, beside
`streamfusion plan --serve`'s prediction.

For each R (one server at a time, R = 1 first): start `serve --model M --replicas R` (serve_load.start), send
SEQUENTIAL requests one after another (latency of one request: the median), then REQUESTS requests from
2 x R concurrent clients, a bounded closed loop that keeps every group busy with one request waiting behind it
(images or videos per minute: answers 200 over the loop's wall time), then SIGTERM. Loopback only (127.0.0.1).
The prediction is `plan --serve --json` for the same model, size, steps and P (none for the tiny models: no record).

Imports the standard library, httpx and serve_load.py beside it. Writes OUT/serve_replicas.json and prints one line
per R and which R the plan recommends against which measured best.

    python benchmarks/serve_replicas.py --out OUT --model flux-dev [--size 1024] [--steps 8] [--requests 16] [--cpu]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import ROOT, command, request, start  # noqa: E402

SEQUENTIAL = 3  # requests one at a time: the latency of one request
CPU_RANKS = 4  # serve's gloo processes on a machine without GPUs


def gpus(cpu: bool) -> int:
    """Ranks serve starts here: one per visible GPU, else CPU_RANKS."""
    if cpu:
        return CPU_RANKS
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return len(visible.split(",")) if visible else len(listed.strip().splitlines())


def predicted(model: str, ranks: int, steps: int, size: list[str]) -> dict:
    """plan --serve's JSON, or the one line it refused with."""
    resolution = ["--resolution", size[1]] if size else []
    done = subprocess.run(command("plan", "--serve", "--json", "--machines", "1", "--gpus-per-machine", str(ranks),
                                  "--model", model, "--steps", str(steps), *resolution),
                          cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout)


def measure(model: str, replicas: int, steps: int, requests: int, size: list[str], cpu: list[str]) -> dict:
    proc, url, layout, ready_s, err = start(model, [*size, "--replicas", str(replicas)], cpu)
    try:
        with httpx.Client(base_url=url) as http:
            sequential = [request(http, steps, seed) for seed in range(SEQUENTIAL)]
            clients = 2 * replicas
            began = time.monotonic()
            with ThreadPoolExecutor(clients) as pool:
                load = list(pool.map(lambda s: request(http, steps, s), range(100, 100 + requests)))
            elapsed = time.monotonic() - began
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    ok = [r for r in load if r["status"] == 200]
    seconds = [r["seconds"] for r in sequential if r["status"] == 200]
    return {"replicas": replicas, "layout": layout, "ready_s": ready_s, "latency_s": seconds,
            "latency_median_s": statistics.median(seconds) if seconds else None, "clients": clients,
            "requests": requests, "ok": len(ok), "errors": [r for r in load if r["status"] != 200][:3],
            "per_minute": 60 * len(ok) / elapsed, "load_s": elapsed, "drain_exit_code": code,
            "stderr_tail": "".join(err)[-500:] if code else ""}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "outputs"))
    parser.add_argument("--model", default="flux-dev")
    parser.add_argument("--size", type=int, default=None, help="pixels a side (default: the model's)")
    parser.add_argument("--steps", type=int, default=8, help="denoising steps per request (default 8, fewer than "
                                                             "flux-dev's 28 so every R fits the job's minutes)")
    parser.add_argument("--requests", type=int, default=16, help="requests of the closed loop, per R")
    parser.add_argument("--cpu", action="store_true", help="dry run on the CPU (tiny models, 4 gloo ranks)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size = ["--height", str(args.size), "--width", str(args.size)] if args.size else []
    cpu = ["--cpu"] if args.cpu else []
    ranks = gpus(args.cpu)
    plan = predicted(args.model, ranks, args.steps, size)
    by_r = {s["replicas"]: s for s in plan.get("splits", [])}
    results = []
    for replicas in (r for r in range(1, ranks + 1) if ranks % r == 0):
        try:
            row = measure(args.model, replicas, args.steps, args.requests, size, cpu)
        except Exception as err:  # noqa: BLE001 - one split's failure is recorded, the next one still runs
            row = {"replicas": replicas, "error": f"{type(err).__name__}: {err}"[-2000:]}
        row["predicted"] = by_r.get(replicas)
        results.append(row)
        report = {"model": args.model, "gpus": ranks, "steps": args.steps, "size": args.size, "plan": plan,
                  "splits": results}
        (out / "serve_replicas.json").write_text(json.dumps(report, indent=2) + "\n")
        if "error" in row:
            print(f"{replicas} x {ranks // replicas}: FAILED {row['error'][-300:]}", flush=True)
            continue
        guess = row["predicted"]
        versus = (f" (plan: {guess['latency_s']:.2f} s, {guess['per_minute']:.2f}/min"
                  f"{'' if guess['excluded'] is None else ', excluded'})") if guess else ""
        print(f"{replicas} x {ranks // replicas} ({row['layout']}): ready {row['ready_s']:.0f} s; latency "
              f"{row['latency_median_s']:.2f} s, {row['per_minute']:.2f} per minute over {row['ok']}/{row['requests']} "
              f"from {row['clients']} clients{versus}; drain exit {row['drain_exit_code']}", flush=True)
    measured = [r for r in results if "error" not in r and r["ok"]]
    if measured:
        best = max(measured, key=lambda r: r["per_minute"])
        fastest = min(measured, key=lambda r: r["latency_median_s"])
        said = (f"plan: lowest latency R = {plan['lowest_latency']['replicas']}, most per minute R = "
                f"{plan['most_per_minute']['replicas']}" if "splits" in plan else f"plan: {plan.get('error')}")
        print(f"measured: lowest latency R = {fastest['replicas']}, most per minute R = {best['replicas']} "
              f"({best['per_minute']:.2f}); {said}", flush=True)
    return 0 if len(measured) == len(results) and all(r["ok"] == r["requests"] for r in measured) else 1


if __name__ == "__main__":
    sys.exit(main())
