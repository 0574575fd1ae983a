#!/usr/bin/env bash
# "Fast by default" on 1 x 4 in one call (under 10 minutes, 6 files under $OUT): `generate` flux-dev 1024 at P = 4
# and P = 1 on the same machine, default flags (CUDA graphs) and --no-cuda-graph (default_path_gpu.sh: the eager
# bar is 0.55x the one-GPU step, the graphed one 0.30x); the host's Python calls and microseconds per attention
# call and block at P = 4; a warm served 28-step request and the server's ready time, by stage, with each answer's
# split (serve needs the `serve` extra's wheels: fastapi, starlette, pydantic, uvicorn, python-multipart,
# prometheus_client, httpx).
# Run from the project root on 4 GPUs: bash benchmarks/fast_default_gpu.sh
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; mkdir -p "$OUT"
GEN_PS="4 1" OUT=$OUT bash benchmarks/default_path_gpu.sh  # default_path.json: plan --serve's step records
timeout 90 torchrun --nproc-per-node 4 benchmarks/host_path.py --layouts ulysses --heads 24 --head-dim 128 \
  --grid 64x64 --text 512 --label gpu4 2>&1 | grep -E "^(layout|diffusers|ulysses)" > "$OUT/host_path.log"
timeout 200 python benchmarks/serve_load.py --out /tmp/serve --models flux-dev --steps 28 --requests 4 \
  > "$OUT/serve.log" 2>&1
cp /tmp/serve/serve_gpu.json "$OUT/serve_gpu.json" 2>/dev/null
