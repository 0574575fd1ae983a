#!/usr/bin/env bash
# The copy-engine transport on 1 x 4 in one call (under 9 minutes, 5 files under $OUT): its GPU tests (pulled
# all-to-alls bit-identical to NCCL's; graph replays bit-identical to eager), the probe (an all-to-all beside a
# GEMM filling every SM: NCCL with its own CTA count and capped, copy-engine pulls, eagerly and replayed; the
# copy-engine timers), then a graphed flux-dev 1024 step with and without it (stock, the single blocks' MLP
# overlap, and the MLP overlap with no SMs left by the GEMMs, which the copy engines do not need).
# Run from the project root on 4 GPUs: bash benchmarks/copy_engine_gpu.sh
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; mkdir -p "$OUT"
timeout 200 python -m pytest -x -q tests/test_copy_engine_gpu.py tests/test_graphs.py -k "copy or rotary" \
  > "$OUT/ce_tests.log" 2>&1
echo "tests: exit $?" > "$OUT/copy_engine.log"; tail -3 "$OUT/ce_tests.log" >> "$OUT/copy_engine.log"
timeout 120 torchrun --nproc-per-node 4 benchmarks/ce_a2a_probe.py > "$OUT/ce_probe.log" 2>&1
echo "probe: exit $?" >> "$OUT/copy_engine.log"; grep -E '^[^ ]+_(us|exact|error): |^\{' "$OUT/ce_probe.log" | head -60 >> "$OUT/copy_engine.log"
timeout 200 torchrun --nproc-per-node 4 benchmarks/overlap_bench.py --workloads flux-dev:1024 \
  --variants stock,mlp,stock+ce,mlp+ce,mlp@0+ce --graph graph --repeats 10 --out "$OUT/ce_step.json" \
  > "$OUT/ce_step.log" 2>&1
echo "step: exit $?" >> "$OUT/copy_engine.log"; grep -E '^\{' "$OUT/ce_step.log" | cut -c1-300 >> "$OUT/copy_engine.log"
