#!/usr/bin/env bash
# session 40 call 5: serve ready with the early fork server (cold caches first), against the package before it; generate at P = 4
set -u
export PYTHONUNBUFFERED=1
BASE=$PYTHONPATH
L=$OUT/call5.log
date -u > $L; nvidia-smi --query-gpu=name --format=csv,noheader | head -1 >> $L
for v in new-cold before new; do
  if [ $v = before ]; then export PYTHONPATH=$BASE:$PWD/.dev/main:$PWD; else export PYTHONPATH=$BASE:$PWD; fi
  timeout 150 python benchmarks/serve_load.py --out /tmp/serve-$v --models flux-dev --steps 28 --requests 2 > "$OUT/serve_$v.log" 2>&1
  cp /tmp/serve-$v/serve_gpu.json "$OUT/serve_$v.json" 2>/dev/null
  echo "== $v" >> $L; grep -E "ready in" $OUT/serve_$v.log >> $L; date -u >> $L
done
export PYTHONPATH=$BASE:$PWD
for flags in "" "--no-cuda-graph"; do
  echo "== generate P = 4 ${flags:-default}" >> $L
  t0=$(date +%s%N)
  timeout 120 python -m streamfusion_diffusers generate --model flux-dev --height 1024 --width 1024 --steps 8 --output /tmp/gen$flags $flags 2>&1 | grep -E "^streamfusion generate: flux|^phases" >> $L
  echo "wall $(( ($(date +%s%N) - t0) / 1000000 )) ms" >> $L
done
date -u >> $L
