#!/usr/bin/env bash
# "Fast by default" and "Torus across machines" on 1 x 4 in one call: the step of flux-dev 1024 and qwen-image
# 1328 at U4R1 (ours eager, ours from CUDA graphs with the pipelined Ulysses, diffusers' context parallelism,
# the no-communication bound eager and graphed), the same for flux-dev without the pipeline (--overlap-groups 1),
# one Torus / USP layer of Flux 4096 over emulated 2 x 2 and 4 x 1 p4de machines on the default torch transport
# (the hang of 2026-11-26), and `generate --compile` at P = 4. Logs and tables under $OUT (8 files at most).
# Run from the project root on 4 GPUs: bash benchmarks/fast_default_gpu.sh
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; mkdir -p "$OUT"
sf() { python -m streamfusion_diffusers "$@"; }
bench4() { sf launch --nproc-per-node 4 -m streamfusion_diffusers bench "$@"; }
timeout 230 bash -c "$(declare -f sf bench4); bench4 --level step --workloads flux-dev:1024,qwen-image:1328 \
  --methods ulysses,diffusers-cp --layouts U4R1 --variants eager,cuda-graph --out /tmp/step" > "$OUT/step.log" 2>&1
cp /tmp/step/table.md "$OUT/step.md" 2>/dev/null
timeout 120 bash -c "$(declare -f sf bench4); bench4 --level step --workloads flux-dev:1024 --methods ulysses \
  --layouts U4R1 --variants cuda-graph --overlap-groups 1 --out /tmp/step-g1" > "$OUT/step-g1.log" 2>&1
cp /tmp/step-g1/table.md "$OUT/step-g1.md" 2>/dev/null
for m in 2 4; do
  timeout 110 bash -c "$(declare -f sf bench4); bench4 --level layer --workloads flux-dev:4096 --machines $m \
    --emulate-link p4de --methods usp,torus --backend torch --timeout 90 --out /tmp/torus-m$m" >> "$OUT/torus.log" 2>&1
  echo "=== machines $m: exit $?" >> "$OUT/torus.log"; cat /tmp/torus-m$m/table.md >> "$OUT/torus.md" 2>/dev/null
done
timeout 200 python -m streamfusion_diffusers generate --model flux-dev --height 1024 --width 1024 --steps 8 --compile \
  --output /tmp/compiled > "$OUT/compile.log" 2>&1; echo "exit $?" >> "$OUT/compile.log"
cp /tmp/compiled/run.json "$OUT/compile_run.json" 2>/dev/null
