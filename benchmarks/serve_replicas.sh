#!/usr/bin/env bash
# Issue 35 item 1 on one host of P GPUs (nvidia-h100-x2 first, then x4 / x8 when lent): `streamfusion serve
# --replicas R` for every R dividing P, one server at a time, flux-dev 1024 x 1024 with 8 denoising steps per
# request (28 is the model's; 8 keeps the whole job near 4 minutes on 1 x 2 H100: about 40 s to ready and 3 + 16
# requests per R), random weights, bf16: latency of one request and images per minute under a closed loop of 2 x R
# clients from 127.0.0.1, beside `streamfusion plan --serve`'s prediction. One line per R, then which R the plan
# recommends against which measured best; everything in $OUT/serve_replicas.json. Needs the serve extra (fastapi,
# uvicorn) and httpx; it reuses benchmarks/serve_load.py. Run from the project root: bash benchmarks/serve_replicas.sh
# Other models / sizes: SERVE_MODEL=qwen-image SERVE_SIZE=1328 bash benchmarks/serve_replicas.sh
# CPU dry run (tiny-flux on 4 gloo ranks as 1 x 4, 2 x 2, 4 x 1; no prediction: the tiny models have no record):
#   SERVE_MODEL=tiny-flux SERVE_SIZE= SERVE_STEPS=2 SERVE_REQUESTS=8 SERVE_CPU=1 bash benchmarks/serve_replicas.sh
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; mkdir -p "$OUT"
SIZE=${SERVE_SIZE-1024}
timeout 480 python benchmarks/serve_replicas.py --out "$OUT" --model "${SERVE_MODEL:-flux-dev}" \
  ${SIZE:+--size "$SIZE"} --steps "${SERVE_STEPS:-8}" --requests "${SERVE_REQUESTS:-16}" ${SERVE_CPU:+--cpu} "$@"
