#!/usr/bin/env bash
# session 42 call 4 (4 x H100): the step bench's USP U2R2 over emulated 2 x 2 that stopped at layer 55 (call 3),
# with the per-rank hang report; then the same layout over 2 x 2 without the link emulation
set -u
export PYTHONUNBUFFERED=1
for e in "--emulate-link p4de" ""; do
  name=e${e:+_p4de}; name=${name// /}
  timeout 110 python -m streamfusion_diffusers -v launch --nproc-per-node 4 -m streamfusion_diffusers -v bench --level step \
    --workloads flux-dev:4096 --machines 2 $e --backend torch --methods usp --layouts U2R2 --warmup 1 --iters 2 \
    --timeout 60 --out /tmp/$name > /tmp/$name.log 2>&1
  echo "$name: exit $?" | tee -a $OUT/call4.log
  grep -E "^streamfusion: rank|^\| " /tmp/$name.log | cut -c1-700 >> $OUT/call4.log
  gzip -c /tmp/$name.log > $OUT/$name.log.gz
done
