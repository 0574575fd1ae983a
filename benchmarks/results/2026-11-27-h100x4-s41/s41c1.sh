#!/usr/bin/env bash
# session 41 call 1: pending GPU tests, default generate on a fresh machine, where the graphed step's 10 ms go
set -u
export PYTHONUNBUFFERED=1
L=$OUT/call1.log
date -u > $L; nvidia-smi --query-gpu=name --format=csv,noheader | head -1 >> $L; git log --oneline -1 >> $L 2>/dev/null
echo "== generate default (fresh)" >> $L
timeout 120 python -m streamfusion_diffusers generate --model flux-dev --height 1024 --width 1024 --steps 8 -v --output /tmp/gen > $OUT/generate.log 2>&1
grep -E "^streamfusion generate: flux|^phases|first step|warm" $OUT/generate.log | cut -c1-600 >> $L; date -u >> $L
timeout 60 torchrun --nproc-per-node 4 .dev/a2a_probe.py > $OUT/probe.log 2>&1; grep '^{' $OUT/probe.log >> $L; tail -5 $OUT/probe.log >> $OUT/probe.tail
date -u >> $L
mkdir -p $OUT/trace; timeout 200 torchrun --nproc-per-node 4 benchmarks/overlap_bench.py --workloads flux-dev:1024 --variants stock,mlp --graph graph --repeats 10 --profile --trace $OUT/trace --out $OUT/overlap.json > $OUT/overlap.full 2>&1
grep -E '^\{|Error' $OUT/overlap.full | cut -c1-3000 >> $L; tail -c 3000 $OUT/overlap.full > $OUT/overlap.tail; rm -f $OUT/overlap.full
gzip -f $OUT/trace/*.json 2>/dev/null
date -u >> $L
timeout 150 python -m pytest -x -q tests/test_kernels_gpu.py tests/test_graphs.py > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log >> $L
date -u >> $L
