"""A served request over an emulated inter-machine link, per method: where Torus's gain over USP shows in serving.

For each method (one server at a time): start `streamfusion serve --model M --machines N --gpus-per-machine G
--emulate-link LINK --method METHOD` (serve_load.start; one host's GPUs stand in for N machines), send REQUESTS
requests one after another, and keep each answer's seconds, its run's denoising seconds, its layout and what
rank 0 sent across machines in the call (`crossed`: under CUDA graphs a replay posts nothing, so it counts 0 there
while the link is still paid; --no-cuda-graph counts every call). Then SIGTERM. Loopback only (127.0.0.1).

Imports the standard library, httpx and serve_load.py beside it. Writes OUT/serve_link.json and prints one line per
method (median request and denoising seconds).

    python benchmarks/serve_link.py --out OUT --model flux-dev --machines 2 --gpus-per-machine 4 --link p4de \
        [--methods torus,usp] [--size 1024] [--steps 8] [--requests 4] [-- EXTRA SERVE ARGS]
"""
from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import PROMPT, start  # noqa: E402


def measure(model: str, method: str, serve_args: list[str], steps: int, requests: int) -> dict:
    proc, url, layout, ready_s, _ = start(model, [*serve_args, "--method", method], [])
    print(f"{method}: ready in {ready_s:.1f} s as {layout}", flush=True)
    try:
        runs = []
        with httpx.Client(base_url=url) as http:
            for seed in range(requests):
                began = time.monotonic()
                answer = http.post("/v1/images/generations", timeout=600,
                                   json={"prompt": PROMPT, "seed": seed, "num_inference_steps": steps})
                if answer.status_code != 200:
                    return {"method": method, "error": f"{answer.status_code}: {answer.text[:300]}"}
                run = answer.json()["streamfusion"]["runs"][0]
                runs.append({"seconds": time.monotonic() - began, "denoising_s": run["phases_s"]["denoising"],
                             "crossed": run["crossed"], "layout": run["layout"]})
                print(f"{method}: request {seed}: {runs[-1]['seconds']:.3f} s", flush=True)
        return {"method": method, "served_as": layout, "ready_s": ready_s, "runs": runs,
                "median_s": statistics.median(r["seconds"] for r in runs),
                "median_denoising_s": statistics.median(r["denoising_s"] for r in runs)}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="flux-dev")
    parser.add_argument("--machines", type=int, default=2)
    parser.add_argument("--gpus-per-machine", type=int, required=True)
    parser.add_argument("--link", default="p4de", help="--emulate-link: dgx, p4de, p5 or GBPS:LATENCY_US")
    parser.add_argument("--methods", default="torus,usp")
    parser.add_argument("--size", default=None, help="pixels per side (default: the model's)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("extra", nargs="*", help="more serve arguments, after --")
    args = parser.parse_args()
    serve_args = ["--machines", str(args.machines), "--gpus-per-machine", str(args.gpus_per_machine),
                  "--emulate-link", args.link, *(["--height", args.size, "--width", args.size] if args.size else []),
                  *args.extra]
    results = [measure(args.model, m, serve_args, args.steps, args.requests) for m in args.methods.split(",")]
    for r in results:
        print(f"{r['method']}: {r['error']}" if "error" in r else
              f"{r['method']}: {r['served_as']}: request {r['median_s']:.3f} s, denoising "
              f"{r['median_denoising_s']:.3f} s (median of {len(r['runs'])}), crossed {r['runs'][-1]['crossed']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_link.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
