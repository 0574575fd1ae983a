#!/usr/bin/env bash
# Sharded weights with the streamed blocks tensor-parallel (`--streamed-blocks tensor`) against gathered ones, on
# 1 x 4 in one call (under 10 minutes, a few files under $OUT): the GPU tests of the tensor-parallel path (graph
# replays bit-identical to eager), then flux2-dev 1024 transformer steps at the layout `auto` picks: whole weights,
# every block gathered, every block tensor-parallel, and the planner's split for 30 GiB both ways, eager and in
# CUDA graphs (benchmarks/shard_bench.py: min / median / max of the slowest rank, peak per GPU, planned peak).
# Qwen-Image 1328 next: WORKLOADS=qwen-image:1328 bash benchmarks/shard_multigpu.sh --weights whole,sharded,tensor
# Run from the project root on 4 GPUs: bash benchmarks/tensor_blocks_gpu.sh
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 > "$OUT/tests.log"
timeout 120 python -m pytest -x -q tests/test_graphs.py -k "sharded" >> "$OUT/tests.log" 2>&1
timeout 60 python -m pytest -x -q tests/test_watch_gpu.py >> "$OUT/tests.log" 2>&1
timeout 420 torchrun --nproc-per-node 4 benchmarks/shard_bench.py --workloads flux2-dev:1024 --modes eager,graph \
  --weights whole,sharded,tensor,split,tensor-split --max-memory 30 --out "$OUT/shard_flux2.json" 2>&1 \
  | grep -E '^\{|Error|error' | cut -c1-900 > "$OUT/shard_flux2.log"
