#!/usr/bin/env bash
# Sharded weights at P = 2 and P = 4 (nvidia-h100-x2, nvidia-h100-x4): per workload one torchrun job over every
# visible GPU, at the layout method "auto" picks (as generate does), the transformer (bf16, random weights) with
# whole weights, every block sharded, and the planner's partial split for --max-memory GIB (default: halfway between
# the two); modes eager and graph (the forward replayed from a CUDA graph), compiled with MODES=eager,graph,compiled.
# Per row: the step's min / median / max of the slowest rank, peak and between-forwards memory of the fullest GPU,
# the planned peak and, sharded, the split. Workloads (WORKLOADS=...): flux2-dev 1024, qwen-image 1328, one
# wan2.2-t2v-a14b expert at 81 x 480 x 832, flux2-dev 2048; one job each (each under 8 minutes); one JSON line per
# row, all in $OUT/shard_multigpu_P<P>_<workload>.json. Extra arguments go to benchmarks/shard_bench.py
# (--max-memory 40, --method ulysses, --repeats 9). Run from the project root:
#   bash benchmarks/shard_multigpu.sh                            # every visible GPU, every workload
#   WORKLOADS=flux2-dev:1024 bash benchmarks/shard_multigpu.sh   # one workload
#   NPROC=2 bash benchmarks/shard_multigpu.sh                    # P = 2 on a larger host
#   bash benchmarks/shard_multigpu.sh pipeline   # whole Flux.2-dev pipeline, --shard-weights (24B encoder sharded
#                                                # too; built in host memory: about 112 GB of RAM per process)
# CPU dry run (tiny stand-ins over gloo; the graph rows say why they did not run):
#   DEVICE=cpu NPROC=2 bash benchmarks/shard_multigpu.sh
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
for workload in ${WORKLOADS:-flux2-dev:1024 qwen-image:1328 wan2.2-t2v-a14b:81:480:832 flux2-dev:2048}; do
  timeout 480 torchrun --nproc-per-node "$NPROC" benchmarks/shard_bench.py --device "${DEVICE:-cuda}" \
    --modes "${MODES:-eager,graph}" --workloads "$workload" --out "$OUT/shard_multigpu_P${NPROC}_${workload//:/_}.json" \
    "$@" 2>&1 | grep -E '^\{|Error|error' | cut -c1-800
done
