#!/usr/bin/env bash
# session 40 call 2 (tree: branch gpu-forkserver; .dev/main = main's package): GPU pool tests, serve ready main vs branch, default generate P=4, emulated step bench
set -u
export PYTHONUNBUFFERED=1
BASE=$PYTHONPATH
date -u > $OUT/tests.log; nvidia-smi --query-gpu=name --format=csv,noheader | head -1 >> "$OUT/tests.log"
export PYTHONPATH=$BASE:$PWD
timeout 200 python -m pytest -x -q tests/test_pool_gpu.py tests/test_graphs.py >> "$OUT/tests.log" 2>&1
date -u >> $OUT/tests.log
for v in branch main; do
  if [ $v = main ]; then export PYTHONPATH=$BASE:$PWD/.dev/main:$PWD; else export PYTHONPATH=$BASE:$PWD; fi
  timeout 150 python benchmarks/serve_load.py --out /tmp/serve-$v --models flux-dev --steps 28 --requests 2 > "$OUT/serve_$v.log" 2>&1
  cp /tmp/serve-$v/serve_gpu.json "$OUT/serve_$v.json" 2>/dev/null
  date -u >> $OUT/tests.log
done
export PYTHONPATH=$BASE:$PWD
timeout 150 python -m streamfusion_diffusers launch --nproc-per-node 4 -m streamfusion_diffusers bench --level step --workloads flux-dev:4096 \
  --machines 2 --emulate-link p4de --methods usp,torus,diffusers-cp --layouts U2R2,U4R1,U2R2T2 --timeout 60 > $OUT/emu_step_m2.log 2>&1
date -u >> $OUT/tests.log
