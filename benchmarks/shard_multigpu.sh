#!/usr/bin/env bash
# Issue 33's runs for issue 35 (nvidia-h100-x2, then nvidia-h100-x4): sharded weights against whole ones at P = 2 and
# P = 4 (ulysses 1 x P), eager and compiled (compile_repeated_blocks, inductor): step time of the slowest rank, peak
# and between-forwards memory of the fullest GPU, `plan --memory`'s estimate beside, for flux2-dev 1024, qwen-image
# 1328 and one wan2.2-t2v-a14b expert at 81 x 480 x 832 (bf16, random weights). One torchrun job per model (each
# under 8 minutes); one JSON line per row, all in $OUT/shard_multigpu_P<P>_<model>.json. Run from the project root:
#   bash benchmarks/shard_multigpu.sh            # every visible GPU
#   NPROC=2 bash benchmarks/shard_multigpu.sh    # P = 2 on a larger host
#   bash benchmarks/shard_multigpu.sh pipeline   # whole Flux.2-dev pipeline, --shard-weights (24B encoder sharded
#                                                # too; built in host memory: about 112 GB of RAM per process)
# CPU dry run (tiny stand-ins, 4 gloo processes, eager and aot_eager): DEVICE=cpu NPROC=4 bash benchmarks/shard_multigpu.sh
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; mkdir -p "$OUT"
NPROC=${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}
if [ "${1:-}" = pipeline ]; then
  timeout 580 torchrun --nproc-per-node "$NPROC" -m streamfusion_diffusers generate --model flux2-dev --shard-weights \
    --steps 2 --method ulysses --output "$OUT/flux2-dev-sharded-P$NPROC" 2>&1 | grep -E 'streamfusion generate|phases|Error|error:'
  python -c "import json,sys; r=json.load(open(sys.argv[1])); print(json.dumps({k: r[k] for k in ('model','world_size', \
'sharded','step_latency_s','phases_s','peak_memory_gib')}))" "$OUT/flux2-dev-sharded-P$NPROC/run.json"
  exit
fi
for workload in ${WORKLOADS:-flux2-dev:1024 qwen-image:1328 wan2.2-t2v-a14b:81:480:832}; do
  timeout 480 torchrun --nproc-per-node "$NPROC" benchmarks/shard_bench.py --device "${DEVICE:-cuda}" \
    --modes eager,compiled --workloads "$workload" --out "$OUT/shard_multigpu_P${NPROC}_${workload%%:*}.json" "$@" \
    2>&1 | grep -E '^\{|Error|error' | cut -c1-400
done
