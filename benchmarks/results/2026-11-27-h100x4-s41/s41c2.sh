#!/usr/bin/env bash
# session 41 call 2: GEMM SM carveout against the exchange beside it; the MLP overlap with it in a graphed step; default generate
set -u
export PYTHONUNBUFFERED=1
L=$OUT/call2.log
date -u > $L; nvidia-smi --query-gpu=name --format=csv,noheader | head -1 >> $L
timeout 90 torchrun --nproc-per-node 4 .dev/a2a_probe2.py > $OUT/probe2.log 2>&1; grep '^{' $OUT/probe2.log >> $L; tail -5 $OUT/probe2.log > $OUT/probe2.tail
date -u >> $L
timeout 240 torchrun --nproc-per-node 4 benchmarks/overlap_bench.py --workloads flux-dev:1024 --variants stock,mlp,mlp@8,mlp@16,mlp@24,mlp@32 --graph graph --repeats 10 --out $OUT/overlap2.json > $OUT/overlap2.full 2>&1
grep -E '^\{|Error' $OUT/overlap2.full | cut -c1-400 >> $L; tail -c 3000 $OUT/overlap2.full > $OUT/overlap2.tail; rm -f $OUT/overlap2.full
date -u >> $L
echo "== generate default (fresh)" >> $L
timeout 120 python -m streamfusion_diffusers -v generate --model flux-dev --height 1024 --width 1024 --steps 8 --output /tmp/gen > $OUT/generate.log 2>&1
grep -E "^streamfusion generate: flux|^phases|first step|warm|kernel" $OUT/generate.log | cut -c1-600 >> $L; date -u >> $L
