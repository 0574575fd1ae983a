#!/usr/bin/env bash
# session 36, x4 call 2: the U4R1 step on torch vs nvshmem under graphs; flux2-dev 1024 sharded on 4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for b in nvshmem; do
  timeout 170 python -m streamfusion_diffusers launch --nproc-per-node 4 -m streamfusion_diffusers bench --level step \
    --workloads flux-dev:1024 --methods ulysses --layouts U4R1 --variants cuda-graph --backend $b --timeout 60 \
    --out $OUT/step_$b 2>&1 | grep -v Warning | grep -v "set up" | tail -15 | tee $OUT/step_$b.log
done
OUT=$OUT WORKLOADS="flux2-dev:1024" timeout 400 bash benchmarks/shard_multigpu.sh --max-memory 30 2>&1 | tee $OUT/shard.log
