#!/usr/bin/env bash
# Session 44's second call on one H200: the one-GPU GPU tests; serve's ready time by stage and a warm served
# flux-dev 1024 request of 28 steps (serve_load.py). Logs under $OUT.
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
timeout 330 python -m pytest -m gpu -x -q -p no:cacheprovider -rs 2>&1 | tail -60 > "$OUT/gpu_tests.log"
echo "gpu tests: exit ${PIPESTATUS[0]}" | tee "$OUT/call2.log"; grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3 | tee -a "$OUT/call2.log"
timeout 230 python benchmarks/serve_load.py --out /tmp/serve --models flux-dev --steps 28 --requests 4 > "$OUT/serve.log" 2>&1
echo "serve_load: exit $?" | tee -a "$OUT/call2.log"; tail -30 "$OUT/serve.log" | tee -a "$OUT/call2.log"
cp /tmp/serve/serve_gpu.json "$OUT/serve_gpu.json" 2>/dev/null
