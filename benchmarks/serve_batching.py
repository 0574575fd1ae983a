"""What dynamic batching buys a served model: images per minute and latency percentiles of `streamfusion serve`
with its default batching against `--max-batch 1`, at 1, 4 and 16 concurrent clients sending same-shape requests.

Each server starts once per mode; each client count runs a warm-up round first (batches of new sizes are captured
into CUDA graphs on their first replays), then a timed round of max(2 x clients, --requests) requests, every
request a distinct prompt and seed. Imports nothing beyond the standard library and httpx (reuses serve_load's
start-up), so it runs on the GPU image as it is.

    python benchmarks/serve_batching.py --model flux-dev --size 1024 --steps 8 --clients 1 4 16 --out OUT
    python benchmarks/serve_batching.py --model tiny-flux --cpu --steps 4 --clients 1 4   # a dry run

Writes OUT/serve_batching_<model>.json and prints one line per mode and client count.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import start  # noqa: E402

MODES = {"batched": [], "unbatched": ["--max-batch", "1"]}


def request(http: httpx.Client, steps: int, index: int) -> tuple[int, float, dict]:
    """One request: its status, client seconds, and where the server spent them (its run record's phases)."""
    started = time.monotonic()
    answer = http.post("/v1/images/generations", timeout=900,
                       json={"prompt": f"a photo of a red cat number {index} on a quiet street", "seed": index,
                             "num_inference_steps": steps})
    seconds = time.monotonic() - started
    if answer.status_code != 200:
        return answer.status_code, seconds, {}
    extra = answer.json()["streamfusion"]
    run = extra["runs"][0]
    return 200, seconds, {"queued_s": extra["queued_s"], "running_s": extra["running_s"],
                          "encode_s": extra["encode_s"], "server_s": extra["seconds"], **run["phases_s"],
                          "step_s": statistics.median(run["step_latency_s"]), "generate_s": run["generate_s"],
                          "batch": run["batch"]}


def round_of(url: str, steps: int, clients: int, count: int, first: int) -> dict:
    with httpx.Client(base_url=url, limits=httpx.Limits(max_connections=clients)) as http:
        began = time.monotonic()
        with ThreadPoolExecutor(clients) as pool:
            answers = list(pool.map(lambda i: request(http, steps, i), range(first, first + count)))
        elapsed = time.monotonic() - began
    seconds = sorted(s for code, s, _ in answers if code == 200)
    phases = [p for code, _, p in answers if code == 200]
    where = {k: statistics.median(p[k] for p in phases) for k in (phases[0] if phases else {})}
    pick = (lambda q: seconds[min(len(seconds) - 1, int(q * len(seconds)))]) if seconds else (lambda q: None)
    return {"clients": clients, "requests": count, "ok": len(seconds), "elapsed_s": elapsed,
            "images_per_minute": 60 * len(seconds) / elapsed, "p50_s": statistics.median(seconds) if seconds else None,
            "p90_s": pick(0.9), "max_s": seconds[-1] if seconds else None,
            "statuses": sorted({code for code, _, _ in answers}), "server_median": where,
            "batches": [p["batch"] for p in phases]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="flux-dev")
    parser.add_argument("--size", type=int, default=None)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--requests", type=int, default=8, help="the fewest requests of a timed round")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "outputs"))
    args = parser.parse_args()
    size = ["--height", str(args.size), "--width", str(args.size)] if args.size else []
    extra = ["--cpu"] if args.cpu else []
    results: dict = {"model": args.model, "size": args.size, "steps": args.steps, "modes": {}}
    for mode in args.modes:
        proc, url, layout, ready_s, err = start(args.model, size, [*extra, *MODES[mode]])
        rows = []
        try:
            for n, clients in enumerate(args.clients):
                count = max(2 * clients, args.requests)
                round_of(url, args.steps, clients, clients, 10_000 * (n + 1))
                row = round_of(url, args.steps, clients, count, 10_000 * (n + 1) + 1000)
                rows.append(row)
                print(f"{args.model} {mode:9s} {clients:2d} clients: {row['images_per_minute']:6.1f} images/min  "
                      f"p50 {row['p50_s']:.2f} s  p90 {row['p90_s']:.2f} s  max {row['max_s']:.2f} s  "
                      f"ok {row['ok']}/{count}  batches {row['batches']}", flush=True)
                print("   server medians: " + "  ".join(f"{k} {v:.3f}" for k, v in row["server_median"].items()),
                      flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=180)
        results["modes"][mode] = {"layout": layout, "ready_s": ready_s, "rounds": rows, "exit_code": code,
                                  "stderr_tail": "".join(err)[-800:] if code else ""}
    if {"batched", "unbatched"} <= results["modes"].keys():
        for b, u in zip(results["modes"]["batched"]["rounds"], results["modes"]["unbatched"]["rounds"]):
            b["over_unbatched"] = b["images_per_minute"] / u["images_per_minute"]
            print(f"{args.model} {b['clients']:2d} clients: batched / unbatched throughput {b['over_unbatched']:.2f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"serve_batching_{args.model}.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
