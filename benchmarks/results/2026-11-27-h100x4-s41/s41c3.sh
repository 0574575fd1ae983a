#!/usr/bin/env bash
# session 41 call 3 (4 x H100): the carveout against the exchange in a graphed step; default generate P = 4 and 1; a warm served 28-step request
set -u
export PYTHONUNBUFFERED=1
L=$OUT/call3.log
date -u > $L; nvidia-smi --query-gpu=name --format=csv,noheader | head -1 >> $L; git log --oneline -1 >> $L 2>/dev/null
timeout 230 torchrun --nproc-per-node 4 benchmarks/overlap_bench.py --workloads flux-dev:1024 --variants stock,mlp@0,mlp,mlp@32 --graph graph --repeats 12 --out $OUT/overlap3.json > $OUT/overlap3.full 2>&1
grep -E '^\{|Error' $OUT/overlap3.full | cut -c1-400 >> $L; tail -c 2000 $OUT/overlap3.full > $OUT/overlap3.tail; rm -f $OUT/overlap3.full
date -u >> $L
for p in 4 1; do
  echo "== generate P = $p default" >> $L
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((p - 1))) timeout 100 python -m streamfusion_diffusers generate --model flux-dev --height 1024 --width 1024 --steps 8 --output /tmp/gen$p > $OUT/generate$p.log 2>&1
  grep -E "^streamfusion generate: flux|^phases|Warning" $OUT/generate$p.log | cut -c1-600 >> $L
done
date -u >> $L
timeout 150 python benchmarks/serve_load.py --out /tmp/serve --models flux-dev --steps 28 --requests 3 > $OUT/serve.log 2>&1
cp /tmp/serve/serve_gpu.json $OUT/serve_gpu.json 2>/dev/null; grep -E "ready in|request|median|s$" $OUT/serve.log | tail -12 >> $L
date -u >> $L
