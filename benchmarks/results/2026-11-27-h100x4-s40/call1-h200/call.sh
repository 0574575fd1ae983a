#!/usr/bin/env bash
# session 40 call 1: tensor-parallel streamed blocks on GPUs (tests, flux2-dev 1024, qwen-image 1328)
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
date -u > $OUT/tests.log; git log --oneline -1 >> $OUT/tests.log 2>/dev/null
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 >> "$OUT/tests.log"
timeout 150 python -m pytest -x -q tests/test_graphs.py -k "sharded" >> "$OUT/tests.log" 2>&1
timeout 60 python -m pytest -x -q tests/test_watch_gpu.py >> "$OUT/tests.log" 2>&1
date -u >> $OUT/tests.log
timeout 330 torchrun --nproc-per-node 4 benchmarks/shard_bench.py --workloads flux2-dev:1024 --modes eager,graph \
  --weights whole,sharded,tensor,tensor-split --max-memory 30 --out "$OUT/shard_flux2.json" > $OUT/shard_flux2.full 2>&1
grep -E '^\{|Error|error' $OUT/shard_flux2.full | cut -c1-1200 > "$OUT/shard_flux2.log"; tail -c 4000 $OUT/shard_flux2.full > $OUT/shard_flux2.tail; rm $OUT/shard_flux2.full
date -u >> $OUT/tests.log
timeout 150 torchrun --nproc-per-node 4 benchmarks/shard_bench.py --workloads qwen-image:1328 --modes eager,graph \
  --weights whole,sharded,tensor --out "$OUT/shard_qwen.json" > $OUT/shard_qwen.full 2>&1
grep -E '^\{|Error|error' $OUT/shard_qwen.full | cut -c1-1200 > "$OUT/shard_qwen.log"; tail -c 3000 $OUT/shard_qwen.full > $OUT/shard_qwen.tail; rm $OUT/shard_qwen.full
date -u >> $OUT/tests.log
