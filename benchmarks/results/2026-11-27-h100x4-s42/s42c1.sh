#!/usr/bin/env bash
# session 42 call 1 (4 x H100): imports cold and compiled; the rotary twins on GPUs; the default path (P = 4 and 1,
# graphs and eager, host path, served 28 steps); graphed U4R1 against U2R2 at flux-dev 1024
set -u
export PYTHONUNBUFFERED=1
L=$OUT/call1.log
date -u > $L; nvidia-smi --query-gpu=name --format=csv,noheader | head -1 >> $L; git log --oneline -1 >> $L 2>/dev/null
imp='import time; t = time.time(); import torch; a = time.time(); import diffusers.pipelines.flux, transformers, streamfusion_diffusers.runtime; print(f"torch {a - t:.2f} s, then diffusers+transformers+ours {time.time() - a:.2f} s")'
echo "imports, no bytecode: $(python -c "$imp" 2>&1 | tail -1)" >> $L
echo "imports, again: $(python -c "$imp" 2>&1 | tail -1)" >> $L
timeout 150 python -m pytest -x -q tests/test_graphs.py tests/test_kernels_gpu.py -k rotary > $OUT/rotary_tests.log 2>&1; tail -2 $OUT/rotary_tests.log >> $L
date -u >> $L
OUT=$OUT bash benchmarks/fast_default_gpu.sh
cat $OUT/generate.log $OUT/host_path.log >> $L; grep -E "ready in" $OUT/serve.log >> $L
date -u >> $L
timeout 200 python -m streamfusion_diffusers launch --nproc-per-node 4 -m streamfusion_diffusers bench --level step --workloads flux-dev:1024 --methods ulysses,usp --layouts U4R1,U2R2 --variants cuda-graph --out /tmp/bench_u4_u2 > $OUT/bench_u4_u2.log 2>&1
echo "bench exit $?" >> $L; cp /tmp/bench_u4_u2/table.md $OUT/bench_u4_u2.md; cat $OUT/bench_u4_u2.md >> $L 2>/dev/null; tail -c 1500 $OUT/bench_u4_u2.log > $OUT/bench_u4_u2.tail; rm -f $OUT/bench_u4_u2.log
date -u >> $L
