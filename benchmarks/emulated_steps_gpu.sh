#!/usr/bin/env bash
# Whole denoising steps across emulated machines on 1 x 4 (issue 39 item 4): flux-dev 4096, the p4de link emulated
# as MACHINES virtual machines (2: 2 x 2, 4: 4 x 1), our USP and Torus against diffusers' context parallelism with
# its collectives booked on the same emulated link (bench/emulated_cp.py), each at the layout that won one layer
# (BENCHMARKS.md, sessions 36-37), eager, the default torch transport. One job per case, so that a slow or stuck
# case costs only itself: its --timeout (per case, from the case's start) ends it with the one line naming the
# collective it waited on and every rank's stack, before the job's outer timeout. An eager 4096 px step takes
# 5-17 s there and a case's first step its one-time work: one warm-up and two timed steps per case. One MACHINES
# value fits one device call (three jobs of at most 3.5 minutes).
# Run from the project root on 4 GPUs: MACHINES=2 bash benchmarks/emulated_steps_gpu.sh, then MACHINES=4
# (CASES="method:layout ..." runs those cases alone; VARIANTS=cuda-graph replays each step from a CUDA graph, the
# link's bookings captured with it; diffusers-cp runs eager whatever VARIANTS says).
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; mkdir -p "$OUT"
m=${MACHINES:-2}
variants=${VARIANTS:-eager}
if [ "$m" = 2 ]; then cases="usp:U2R2 torus:U2R2T2 diffusers-cp:U2R2"; else cases="usp:U4R1 torus:U4R1T4 diffusers-cp:U4R1"; fi
cases=${CASES:-$cases}
for c in $cases; do
  method=${c%%:*}; layout=${c##*:}; name="m${m}_${method}_${layout}_${variants}"
  timeout 210 python -m streamfusion_diffusers launch --nproc-per-node 4 -m streamfusion_diffusers bench \
    --level step --workloads flux-dev:4096 --machines "$m" --emulate-link p4de --backend torch \
    --methods "$method" --layouts "$layout" --variants "$variants" --warmup 1 --iters 2 --timeout 150 \
    --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  echo "$name: exit $?" >> "$OUT/emulated_steps.log"
  cat "$OUT/$name/table.md" >> "$OUT/emulated_steps.log" 2>/dev/null
  rm -rf "$OUT/$name"
  grep -E "^streamfusion: rank" "$OUT/$name.log" | cut -c1-900 >> "$OUT/emulated_steps.log"  # a stall's report
  gzip -f "$OUT/$name.log"  # every rank's stacks, lines marked "rank N| "
done
