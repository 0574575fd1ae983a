#!/usr/bin/env bash
# Whole denoising steps across emulated machines on 1 x 4 in one call (issue 39 item 4; under 10 minutes, a few
# files under $OUT): flux-dev 4096, the p4de link emulated as 2 x 2 and 4 x 1 virtual machines, our USP and Torus
# against diffusers' context parallelism with its collectives booked on the same emulated link
# (bench/emulated_cp.py), each at the layouts that won one layer (BENCHMARKS.md, sessions 36-37), eager, the
# default torch transport. One warm-up round and three timed steps per case: a 4096 px eager step takes seconds,
# and each case's first step its one-time work (kernel and layout choice), so the per-case --timeout is minutes.
# Run from the project root on 4 GPUs: bash benchmarks/emulated_steps_gpu.sh
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; mkdir -p "$OUT"
for m in 2 4; do
  if [ "$m" = 2 ]; then layouts=U2R2,U2R2T2; else layouts=U4R1,U4R1T4; fi
  timeout 270 python -m streamfusion_diffusers launch --nproc-per-node 4 -m streamfusion_diffusers bench \
    --level step --workloads flux-dev:4096 --machines "$m" --emulate-link p4de --backend torch \
    --methods usp,torus,diffusers-cp --layouts "$layouts" --warmup 1 --iters 3 --timeout 200 \
    --out "$OUT/emulated_step_m$m" > "$OUT/emulated_step_m$m.log" 2>&1
  echo "machines $m: exit $?" >> "$OUT/emulated_steps.log"
  cp "$OUT/emulated_step_m$m/table.md" "$OUT/emulated_step_m$m.md" 2>/dev/null
  rm -rf "$OUT/emulated_step_m$m"
  tail -c 3000 "$OUT/emulated_step_m$m.log" > "$OUT/emulated_step_m$m.tail"; rm "$OUT/emulated_step_m$m.log"
done
