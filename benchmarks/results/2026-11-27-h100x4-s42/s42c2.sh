#!/usr/bin/env bash
# session 42 call 2 (4 x H100): a warm served 28-step request and serve's ready time; USP and Torus whole steps over emulated 2 x 2
set -u
export PYTHONUNBUFFERED=1
L=$OUT/call2.log
date -u > $L; nvidia-smi --query-gpu=name --format=csv,noheader | head -1 >> $L
timeout 200 python benchmarks/serve_load.py --out /tmp/serve --models flux-dev --steps 28 --requests 4 > $OUT/serve.log 2>&1
cp /tmp/serve/serve_gpu.json $OUT/serve_gpu.json 2>/dev/null; tail -3 $OUT/serve.log >> $L
date -u >> $L
MACHINES=2 CASES="usp:U2R2 torus:U2R2T2" OUT=$OUT bash benchmarks/emulated_steps_gpu.sh
cat $OUT/emulated_steps.log $OUT/*.md >> $L 2>/dev/null
date -u >> $L
