#!/usr/bin/env bash
# session 42 call 5 (4 x H100): call 4's emulated case again, its deadline (40 s) well inside the job's outer timeout
set -u
export PYTHONUNBUFFERED=1
timeout 150 python -m streamfusion_diffusers -v launch --nproc-per-node 4 -m streamfusion_diffusers -v bench --level step \
  --workloads flux-dev:4096 --machines 2 --emulate-link p4de --backend torch --methods usp --layouts U2R2 --warmup 1 \
  --iters 2 --timeout 40 --out /tmp/e5 > /tmp/e5.log 2>&1
echo "exit $?" | tee $OUT/call5.log
grep -E "^streamfusion: rank" /tmp/e5.log | cut -c1-900 >> $OUT/call5.log
for r in 0 1 2 3; do grep -E "^rank $r\| " /tmp/e5.log | grep -v -E "threading.py|_bootstrap" >> $OUT/call5.log; done
gzip -c /tmp/e5.log > $OUT/e5.log.gz
