#!/usr/bin/env bash
# The exchange beside a GEMM, how many SMs each side gets, on 1 x 4 in one call: a graphed flux-dev 1024 step
# with no overlap ("stock") and the single blocks' MLP beside the exchanges with C SMs left to them ("mlp@C"),
# each under NCCL's default CTA count and under NCCL_MAX_CTAS = 16 and 8 (read when a communicator is made: one
# torchrun job each). A GEMM that fills every SM holds an all-to-all's CTAs back; with the exchange's CTAs fewer
# than the SMs the GEMM leaves, both run at once, at the price of a slower exchange where nothing runs beside it
# (the joint blocks').
# Run from the project root on 4 GPUs: bash benchmarks/overlap_ctas_gpu.sh
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; mkdir -p "$OUT"
for ctas in default 16 8; do
  if [ "$ctas" = default ]; then unset NCCL_MAX_CTAS; else export NCCL_MAX_CTAS=$ctas; fi
  timeout 170 torchrun --nproc-per-node 4 benchmarks/overlap_bench.py --workloads flux-dev:1024 \
    --variants stock,mlp@0,mlp@16,mlp@24 --graph graph --repeats 10 --out "$OUT/overlap_ctas_$ctas.json" \
    > "$OUT/overlap_ctas_$ctas.log" 2>&1
  echo "NCCL_MAX_CTAS=$ctas: exit $?" >> "$OUT/overlap_ctas.log"
  grep -E '^\{' "$OUT/overlap_ctas_$ctas.log" | cut -c1-300 >> "$OUT/overlap_ctas.log"
done
unset NCCL_MAX_CTAS
