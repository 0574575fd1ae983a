#!/usr/bin/env bash
# Issue 32 item 10 on one GPU (nvidia-h100-x1 or nvidia-h200): `streamfusion serve` of flux-dev (1024 x 1024) and
# qwen-image (1328 x 1328), random weights, bf16: start to ready, request latency against generate's warm step x
# steps + decode, requests per minute over 50 requests (4 steps each, so each model fits about 4 minutes), peak
# memory first vs last request, SIGTERM drain exit code. About 7 minutes on an H100; one summary line per model,
# everything in $OUT/serve_gpu.json (+ each model's generate run.json). Needs the serve extra (fastapi, uvicorn)
# and httpx. Run from the project root: bash benchmarks/serve_gpu.sh
# CPU dry run (tiny-flux on 4 gloo ranks, a minute): SERVE_MODELS=tiny-flux SERVE_CPU=1 bash benchmarks/serve_gpu.sh
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; mkdir -p "$OUT"
timeout 530 python benchmarks/serve_load.py --out "$OUT" --models ${SERVE_MODELS:-flux-dev qwen-image} \
  --steps "${SERVE_STEPS:-4}" --requests "${SERVE_REQUESTS:-50}" ${SERVE_CPU:+--cpu} "$@"
