#!/usr/bin/env bash
# Issue 32 item 8 on the visible GPUs (one, or several: generate starts one NCCL process per GPU), in about 8
# minutes: flux-dev 1024 x 1024, 28 steps, random weights, plain and with each stack the command line offers
# (First Block Cache, TaylorSeer, int8 and fp8 weight-only); per run ms/step, peak memory and run.json's "stack".
# Run from the project root with the wheels of ../shared/device/wheels.sh carried in .whl/ (diffusers, torchao,
# peft):  bash benchmarks/stack_gpu.sh        (the run.json files and a summary stack.json go to $OUT)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; mkdir -p "$OUT"
nvidia-smi -L
declare -A STACKS=([plain]="" [first-block]="--cache first-block:0.12" [taylorseer]="--cache taylorseer:3"
                   [int8]="--quantize int8" [fp8]="--quantize fp8")
for name in plain first-block taylorseer int8 fp8; do
  start=$SECONDS
  timeout 240 python3 -m streamfusion_diffusers generate --model flux-dev --height 1024 --width 1024 --steps 28 \
    ${STACKS[$name]} --output "$OUT/$name" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - start)) s: $(grep -E '^(streamfusion generate|stack)' "$OUT/$name.log" | tr '\n' ' ' | cut -c1-300)"
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out, rows = Path(sys.argv[1]), {}
for run in sorted(out.glob("*/run.json")):
    r = json.loads(run.read_text())
    steps = r["step_latency_s"]
    rows[run.parent.name] = {"ms_per_step": round(1e3 * sum(steps) / len(steps), 1), "total_s": round(r["total_s"], 2),
                             "peak_memory_gib": round(r["peak_memory_gib"], 2), "world_size": r["world_size"],
                             "layout": r["layout"], "stack": r["stack"]}
(out / "stack.json").write_text(json.dumps(rows, indent=2) + "\n")
for name, row in rows.items():
    print(f"{name:12s} {row['ms_per_step']:8.1f} ms/step  {row['peak_memory_gib']:6.2f} GiB  {row['stack']}")
PY
