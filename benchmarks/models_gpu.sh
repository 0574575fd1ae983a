#!/usr/bin/env bash
# Issue 23 on one GPU (nvidia-h100-x1 or nvidia-h200): each real-size new model's transformer forward through
# parallelize (P = 1), bf16, random weights: step time and peak memory. Text encoders are not run (random prompt
# embeddings; Flux.2-dev's 24B encoder would not fit beside its transformer). About 5 minutes; one JSON line per
# model on stdout, all of them in $OUT/models_gpu.json. Run from the project root: bash benchmarks/models_gpu.sh
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; mkdir -p "$OUT"
timeout 470 torchrun --nproc-per-node 1 benchmarks/models_gpu.py --out "$OUT/models_gpu.json" "$@" 2>&1 \
  | grep -E '^\{|Error|error' | cut -c1-400
