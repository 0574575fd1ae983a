#!/usr/bin/env bash
# "Fast by default" on 1 x 4 in one call (under 10 minutes, 8 files at most under $OUT): the GPU test of sharded
# weights replayed from a graph; `generate` at P = 4 with default flags (its start-up by stage and the ranks'
# teardown); a warm served 28-step request and the server's ready time, by stage (the limits' planner beside the
# ranks' start); `generate --compile` at P = 4 (compiled and captured); the MLP overlap against the stock step,
# eager, with enough steps to read through the host's noise.
# Run from the project root on 4 GPUs: bash benchmarks/fast_default_gpu.sh
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; mkdir -p "$OUT"
gen() { python -m streamfusion_diffusers generate --model flux-dev --height 1024 --width 1024 --steps 8 "$@"; }
timeout 150 python -m pytest -x -q -m gpu tests/test_graphs.py -k "sharded or ulysses" > "$OUT/gpu_tests.log" 2>&1
echo "exit $?" >> "$OUT/gpu_tests.log"
timeout 100 bash -c "$(declare -f gen); gen --output /tmp/default" 2>&1 | grep -E "^streamfusion generate|^phases" \
  > "$OUT/generate.log"
timeout 200 python benchmarks/serve_load.py --out /tmp/serve --models flux-dev --steps 28 --requests 4 \
  >> "$OUT/generate.log" 2>&1
cp /tmp/serve/serve_gpu.json "$OUT/serve_gpu.json" 2>/dev/null
timeout 150 bash -c "$(declare -f gen); gen --compile --output /tmp/compiled" 2>&1 | grep -E "^streamfusion generate|^phases|rror" \
  >> "$OUT/generate.log"
cp /tmp/compiled/run.json "$OUT/compile_run.json" 2>/dev/null
timeout 120 torchrun --nproc-per-node 4 benchmarks/overlap_bench.py --workloads flux-dev:1024 --variants stock,mlp \
  --graph eager,graph --repeats 20 --out "$OUT/overlap.json" 2>&1 | grep "^{" > "$OUT/overlap.log"
