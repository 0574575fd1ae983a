"""Issue 32 item 10: `streamfusion serve` measured on one GPU (or whatever this machine has), per model:

1. `streamfusion generate` once at the same size and steps: run.json's warm step time (median of steps 2..n),
   text encoding and decode give the expected latency of one request (text + warm step x steps + decode);
2. `streamfusion serve` started: seconds from start to its ready line (ranks, build, warm-up);
3. 5 requests one after another: client latency per request against that expectation;
4. REQUESTS requests from 4 concurrent clients: requests per minute, every answer 200, and each generation's
   peak GPU memory (rank 0, from its record) first vs last, and /metrics' highest (flat: no growth);
5. SIGTERM: the drain's exit code.

Imports nothing beyond the standard library and httpx (the GPU image has no diffusers wheel outside the
package's own). Writes OUT/serve_gpu.json and prints one summary line per model.

    python benchmarks/serve_load.py --out OUT [--models flux-dev qwen-image] [--steps 4] [--requests 50] [--cpu]
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
READY = re.compile(r"^serving \S+ on (http://\S+) \((.*)\)$")
SEQUENTIAL = 5  # requests one at a time: latency
CLIENTS = 4  # concurrent clients of the throughput run (the queue never empties)
PROMPT = "a photo of a red cat on a quiet street at sunset"


STAGE = re.compile(r"group \d+: (.* started in|pipeline built|warm-up done in)")
TRACE = re.compile(r"Traceback|recvValue|TCPStore")  # what a clean stop must not print


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "streamfusion_diffusers", *args]


def expected_latency(model: str, steps: int, size: list[str], cpu: list[str], out: Path) -> dict:
    """generate's warm step time x steps + text encoding + decode, from its run.json."""
    folder = out / f"{model}-generate"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "log.txt", "w") as log:
        subprocess.run(command("generate", "--model", model, "--steps", str(steps), "--prompt", PROMPT, "--output",
                               str(folder), *size, *cpu), check=True, cwd=ROOT, stdout=log, stderr=log)
    run = json.loads((folder / "run.json").read_text())
    steps_s = run["step_latency_s"]
    warm = statistics.median(steps_s[1:] if len(steps_s) > 1 else steps_s)
    phases = run["phases_s"]
    return {"warm_step_s": warm, "text_encoding_s": phases["text_encoding"], "decode_s": phases["decode"],
            "expected_s": phases["text_encoding"] + warm * steps + phases["decode"], "layout": run["layout"],
            "generate_total_s": run["total_s"], "world_size": run["world_size"], "height": run["height"],
            "width": run["width"]}


def start(model: str, size: list[str], cpu: list[str]) -> tuple[subprocess.Popen, str, str, float, list[str]]:
    started = time.monotonic()
    proc = subprocess.Popen(command("-v", "serve", "--model", model, "--port", "0", "--max-queue", "256", *size, *cpu),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    for line in proc.stdout:
        found = READY.match(line.strip())
        if found:
            return proc, found[1], found[2], time.monotonic() - started, err
    raise RuntimeError(f"serve {model} ended before it was ready:\n" + "".join(err)[-3000:])


def request(http: httpx.Client, steps: int, seed: int) -> dict:
    started = time.monotonic()
    answer = http.post("/v1/images/generations", json={"prompt": PROMPT, "seed": seed, "num_inference_steps": steps},
                       timeout=600)
    seconds = time.monotonic() - started
    if answer.status_code != 200:
        return {"status": answer.status_code, "seconds": seconds, "error": answer.text[:300]}
    body = answer.json()
    run = body["streamfusion"]["runs"][0]
    assert base64.b64decode(body["data"][0]["b64_json"])[:8] == b"\x89PNG\r\n\x1a\n"
    said = body["streamfusion"]
    return {"status": 200, "seconds": seconds, "server_s": said["seconds"], "queued_s": said["queued_s"],
            "running_s": said["running_s"], "encode_s": said["encode_s"], "phases_s": run["phases_s"],
            "peak_gib": run["peak_memory_gib"], "total_s": run["total_s"]}


def metric(text: str, name: str) -> float | None:
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(found[1]) if found else None


def measure(model: str, steps: int, requests: int, size: list[str], cpu: list[str], out: Path) -> dict:
    expected = expected_latency(model, steps, size, cpu, out)
    proc, url, layout, ready_s, err = start(model, size, cpu)
    try:
        with httpx.Client(base_url=url) as http:
            sequential = [request(http, steps, seed) for seed in range(SEQUENTIAL)]
            began = time.monotonic()
            with ThreadPoolExecutor(CLIENTS) as pool:
                load = list(pool.map(lambda s: request(http, steps, s), range(100, 100 + requests)))
            elapsed = time.monotonic() - began
            metrics = http.get("/metrics").text
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    ok = [r for r in load if r["status"] == 200]
    peaks = [r["peak_gib"] for r in ok if r["peak_gib"] is not None]
    latency = statistics.median(r["seconds"] for r in sequential if r["status"] == 200)
    return {
        "model": model, "steps": steps, "layout": layout, "ready_s": ready_s, **expected,
        "latency_s": [r["seconds"] for r in sequential], "latency_median_s": latency,
        "sequential": sequential,  # each answer's split: queued, the group's call, PNG, and the call's phases
        "latency_over_expected": latency / expected["expected_s"],
        "requests": requests, "ok": len(ok), "errors": [r for r in load if r["status"] != 200][:3],
        "requests_per_minute": 60 * len(ok) / elapsed, "load_s": elapsed,
        "peak_gib_first": peaks[0] if peaks else None, "peak_gib_last": peaks[-1] if peaks else None,
        "peak_gib_max": max(peaks) if peaks else None,
        "metrics_peak_bytes": metric(metrics, "streamfusion_gpu_memory_peak_bytes"),
        "metrics_ready_s": metric(metrics, "streamfusion_ready_seconds"),
        "drain_exit_code": code, "stderr_tail": "".join(err)[-500:] if code else "",
        "startup": [line.strip() for line in err if STAGE.search(line)],  # the group's start-up, by stage
        "stop_traces": [line.strip() for line in err if TRACE.search(line)][:10],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "outputs"))
    parser.add_argument("--models", nargs="+", default=["flux-dev", "qwen-image"])
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per request (fewer than the models' "
                                                             "28 / 50, so 50 requests fit about 4 minutes)")
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--size", type=int, default=None, help="pixels a side (default: each model's)")
    parser.add_argument("--cpu", action="store_true", help="dry run on the CPU (tiny models, 4 gloo ranks)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size = ["--height", str(args.size), "--width", str(args.size)] if args.size else []
    cpu = ["--cpu"] if args.cpu else []
    results = []
    for model in args.models:
        try:
            results.append(measure(model, args.steps, args.requests, size, cpu, out))
        except Exception as err:  # noqa: BLE001 - one model's failure is recorded, the next one still runs
            results.append({"model": model, "error": f"{type(err).__name__}: {err}"[-2000:]})
        (out / "serve_gpu.json").write_text(json.dumps(results, indent=2) + "\n")
        r = results[-1]
        if "error" in r:
            print(f"{model}: FAILED {r['error'][-300:]}", flush=True)
            continue
        peak = f"{r['peak_gib_first']:.2f} -> {r['peak_gib_last']:.2f} GiB" if r["peak_gib_first"] else "n/a (CPU)"
        print(f"{model} {r['height']}x{r['width']} {r['steps']} steps on {r['world_size']} rank(s) ({r['layout']}): "
              f"ready in {r['ready_s']:.1f} s; latency {r['latency_median_s']:.2f} s vs generate's "
              f"{r['expected_s']:.2f} s (x{r['latency_over_expected']:.2f}); {r['requests_per_minute']:.1f} "
              f"requests/min over {r['ok']}/{r['requests']}; peak memory {peak}; drain exit {r['drain_exit_code']}"
              f" ({len(r['stop_traces'])} trace lines)",
              flush=True)
    return 0 if all("error" not in r and r["ok"] == r["requests"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
