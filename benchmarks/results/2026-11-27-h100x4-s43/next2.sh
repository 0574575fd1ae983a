#!/usr/bin/env bash
# The next session's second call on 4 x H100 (about 6 minutes): the symm-pull transport (Ulysses' all-to-alls as
# one kernel of peer loads from symmetric memory): its GPU tests (bit-identical to NCCL's eagerly; graph replays
# bit-identical to eager), then the graphed flux-dev 1024 step with and without it (stock and the MLP overlap).
# Run from the project root after the device preamble; logs under $OUT.
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
timeout 240 python -m pytest -x -q tests/test_symm_pull_gpu.py tests/test_graphs.py -k "symm or pulled" \
  > "$OUT/pull_tests.log" 2>&1
echo "pull tests: exit $?" | tee "$OUT/next2.log"
grep -E "passed|failed|^E " "$OUT/pull_tests.log" | head -20 >> "$OUT/next2.log"
timeout 240 torchrun --nproc-per-node 4 benchmarks/overlap_bench.py --workloads flux-dev:1024 \
  --variants stock,mlp,stock+pull,mlp+pull --graph graph --repeats 10 --out "$OUT/pull_step.json" \
  > "$OUT/pull_step.log" 2>&1
echo "step: exit $?" >> "$OUT/next2.log"
grep -E '^\{' "$OUT/pull_step.log" | cut -c1-260 >> "$OUT/next2.log"
gzip -f "$OUT/pull_step.log"
cat "$OUT/next2.log"
