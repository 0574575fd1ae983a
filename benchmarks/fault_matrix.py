"""The fault matrix on GPUs (issue 13): a dead or stalled peer ends every other rank with a named error.

For each transport (NCCL, NVSHMEM), method (ulysses, usp with a ring pass, torus) and fault (kill: SIGKILL,
stall: a long sleep), one job runs Flux 2048 px attention layers (16,384 + 512 tokens, 24 heads of 128, bf16);
rank 1 fails at its 4th timed layer. Every other rank must end with an error that names the attention layer,
the stage and the peer within timeout_s + 10 s of the fault. Each rank of a job is its own
process (torchrun's environment, NVSHMEM heap sized for Flux 2048 as `streamfusion launch` sizes it) and logs to
--out/<job>/rank<i>.log. Prints a pass/fail table and writes fault_matrix.json there.

    python3 benchmarks/fault_matrix.py --timeout 8 --out $OUT/faults          # 12 jobs on 2 GPUs, about 4 min
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

STAGES = {"ulysses": ("ulysses all-to-all",), "usp": ("ring pass", "ulysses all-to-all"),
          "torus": ("pull_q", "pull_kv", "push_o", "torus transfer")}
LINE = re.compile(r"^\[rank (\d+) ([\d.]+)\] CRITICAL (.*)$")
SLACK_S = 10.0


def worker(args: argparse.Namespace) -> None:
    """One rank of one job (under torchrun): run the layers, log whatever ends this rank, exit."""
    import torch
    import torch.distributed as dist

    from streamfusion_diffusers.bench.faults import Fault, fault_rank

    rank = int(os.environ["RANK"])
    logging.basicConfig(level=logging.WARNING, force=True, format=f"[rank {rank} %(created).3f] %(levelname)s "
                                                                  f"%(message)s")
    gpu = torch.cuda.is_available()  # gloo on a machine without GPUs: a check of this harness
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if gpu else "gloo", timeout=datetime.timedelta(seconds=300))  # layers: --timeout
    fault = Fault(args.method, args.kind, timeout_s=args.timeout, backend=args.backend)
    if gpu:
        fault = replace(fault, tokens=16384, joint=512, heads=24, head_dim=128, kernel="sdpa")  # no JIT wait
    try:
        status = fault_rank(fault, Path(args.job_dir))
    except Exception as err:  # noqa: BLE001 - the survivor's error is the result
        logging.critical("%s: %s", type(err).__name__, err)
        logging.shutdown()
        os._exit(1)
    logging.critical("%s", status)
    logging.shutdown()
    os._exit(0)


def run_case(backend: str, method: str, kind: str, args: argparse.Namespace, port: int) -> dict:
    """One job: every rank its own process (as on separate machines; under torchrun the agent would end the
    survivors itself within seconds of a death, hiding whether they would have); each rank logs to its file."""
    from streamfusion_diffusers.bench.faults import fault_time
    from streamfusion_diffusers.commands.launch import heap_bytes

    job = Path(args.out) / f"{backend}-{method}-{kind}"
    job.mkdir(parents=True, exist_ok=True)
    (job / "fault_time").unlink(missing_ok=True)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(args.nproc),
           "NVSHMEM_SYMMETRIC_SIZE": str(heap_bytes(16384, 512, 24, 128, 1, args.nproc)), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, __file__, "--worker", "--backend", backend, "--method", method, "--kind", kind,
               "--timeout", str(args.timeout), "--job-dir", str(job)]
    start = time.time()
    procs = [subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=open(job / f"rank{r}.log", "w"), stderr=subprocess.STDOUT)
             for r in range(args.nproc)]
    survivors = [r for r in range(args.nproc) if r != 1]
    deadline = start + args.job_limit
    while time.time() < deadline and any(procs[r].poll() is None for r in survivors):
        time.sleep(0.2)
    ended = time.time()
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    fault = fault_time(job)
    rows = []
    for r in survivors:
        found = [LINE.match(line) for line in (job / f"rank{r}.log").read_text(errors="replace").splitlines()]
        first = next((m for m in found if m), None)
        when, message = (float(first.group(2)), first.group(3)) if first else (None, "no error logged")
        after = None if when is None or fault is None else when - fault
        named = "streamfusion: attention layer" in message and any(s in message for s in STAGES[method]) \
            and re.search(r"rank \d", message) is not None
        rows.append({"rank": r, "after_fault_s": after, "message": message, "exit": procs[r].returncode,
                     "ok": named and after is not None and after <= args.timeout + SLACK_S})
    return {"backend": backend, "method": method, "kind": kind, "job_s": ended - start,
            "job_end_after_fault_s": None if fault is None else ended - fault, "survivors": rows,
            "ok": fault is not None and all(row["ok"] for row in rows)}


def short(message: str) -> str:
    m = re.search(r"attention layer \d+, [^:]*?(from|to|with) (rank \d+|ranks \[[^\]]*\])", message)
    return m.group(0) if m else message[:90]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="torch", help=argparse.SUPPRESS)
    parser.add_argument("--method", default="ulysses", help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="kill", help=argparse.SUPPRESS)
    parser.add_argument("--job-dir", default=".", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=10.0, help="ParallelConfig.timeout_s (default 10)")
    parser.add_argument("--nproc", type=int, default=2, help="GPUs per job (default 2)")
    parser.add_argument("--backends", nargs="+", default=["torch", "nvshmem"], help="torch (NCCL) and/or nvshmem")
    parser.add_argument("--methods", nargs="+", default=["ulysses", "usp", "torus"])
    parser.add_argument("--kinds", nargs="+", default=["kill", "stall"])
    parser.add_argument("--job-limit", type=float, default=75.0, help="seconds before a job counts as hung")
    parser.add_argument("--out", default=os.environ.get("OUT", "outputs") + "/faults")
    args = parser.parse_args()
    if args.worker:
        worker(args)
    from streamfusion_diffusers.runtime.pool import free_port

    results = [run_case(b, m, k, args, free_port()) for b in args.backends for m in args.methods for k in args.kinds]
    Path(args.out, "fault_matrix.json").write_text(json.dumps(results, indent=1))
    print(f"fault matrix: {args.nproc} GPUs, timeout_s {args.timeout:g}, bar: every survivor names the fault "
          f"within {args.timeout + SLACK_S:g} s")
    print(f"{'transport':<9} {'method':<8} {'fault':<6} {'result':<6} {'survivor s':>10} {'job s':>6}  first error")
    for r in results:
        times = [s["after_fault_s"] for s in r["survivors"] if s["after_fault_s"] is not None]
        worst = f"{max(times):.1f}" if times else "-"
        name = "nccl" if r["backend"] == "torch" else r["backend"]
        print(f"{name:<9} {r['method']:<8} {r['kind']:<6} {'PASS' if r['ok'] else 'FAIL':<6} {worst:>10} "
              f"{r['job_s']:>6.1f}  {short(r['survivors'][0]['message'])}")
    print(f"{sum(r['ok'] for r in results)} / {len(results)} passed; logs under {args.out}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
