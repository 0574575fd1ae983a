#!/usr/bin/env bash
# Issue 33 on one GPU (nvidia-h100-x1 or nvidia-h200): shard_weights=True at P = 1 is a no-op (a step timed with and
# without it, eager), and the transformer's measured peak against `plan --memory`'s estimate, for flux-dev 1024,
# qwen-image 1328, flux2-dev 1024 and one wan2.2-t2v-a14b expert at 81 x 480 x 832 (bf16, random weights). About 5
# minutes; one JSON line per row on stdout, all in $OUT/shard_gpu.json. Run from the project root:
#   bash benchmarks/shard_gpu.sh
# CPU dry run (tiny stand-ins, 1 gloo process): DEVICE=cpu bash benchmarks/shard_gpu.sh
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; mkdir -p "$OUT"
timeout 470 torchrun --nproc-per-node 1 benchmarks/shard_bench.py --device "${DEVICE:-cuda}" --modes eager --weights whole,sharded \
  --budget-s 380 --out "$OUT/shard_gpu.json" "$@" 2>&1 | grep -E '^\{|Error|error' | cut -c1-400
