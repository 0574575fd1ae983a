#!/usr/bin/env bash
# session 40 call 6: the whole Flux.2-dev pipeline (24B text encoder, 32B transformer) end to end on 4 x H100, whole against --shard-weights (default streamed blocks: auto)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PYTHONPATH:$PWD
L=$OUT/call6.log
date -u > $L; nvidia-smi --query-gpu=name --format=csv,noheader | head -1 >> $L
for flags in "" "--shard-weights"; do
  echo "== generate flux2-dev 1024 8 steps P = 4 ${flags:-whole}" >> $L
  t0=$(date +%s%N)
  timeout 200 python -m streamfusion_diffusers generate --model flux2-dev --steps 8 --output /tmp/f2$flags $flags > /tmp/f2$flags.log 2>&1
  echo "rc $? wall $(( ($(date +%s%N) - t0) / 1000000 )) ms" >> $L
  grep -E "^streamfusion generate|^phases|rror" /tmp/f2$flags.log | cut -c1-1500 >> $L
  python - /tmp/f2$flags/run.json >> $L 2>&1 <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print({k: r.get(k) for k in ("layout", "peak_memory_gib", "encoded_first", "sharded", "streamed_blocks", "weight_split", "cuda_graph", "step_latency_s", "phases_s")})
PY
  cp /tmp/f2$flags/run.json $OUT/run${flags:-_whole}.json 2>/dev/null
done
date -u >> $L
echo "== shard_bench flux2-dev 1024 on this machine" >> $L
timeout 150 torchrun --nproc-per-node $(nvidia-smi -L | wc -l) benchmarks/shard_bench.py --workloads flux2-dev:1024 --modes graph --weights whole,tensor,sharded --out $OUT/shard_flux2.json 2>&1 | grep -E '^\{|Error|error' | cut -c1-700 >> $L
date -u >> $L
