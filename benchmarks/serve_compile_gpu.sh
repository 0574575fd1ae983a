#!/usr/bin/env bash
# `streamfusion serve --compile` against eager serve, flux-dev 1024 x 1024 (random weights, bf16) on the visible
# GPUs: seconds from start to ready (/health 200) and of the first two requests, for eager serve, then --compile on
# an empty compile cache (cold), then --compile restarted on the filled cache (warm); the warm server also takes
# one request of a size it did not warm (768x1344: the stall a new size costs, as /metrics counts it). What decides
# serve's --compile default. One line per run in $OUT/serve_compile.tsv, each server's log in $OUT/<run>.log, its
# /health and /metrics after the requests in $OUT/<run>.health.json and $OUT/<run>.metrics.txt.
# Needs the serve extra and curl. Run from the project root: bash benchmarks/serve_compile_gpu.sh
# CPU dry run (tiny-flux on 2 gloo ranks, aot_eager): SERVE_MODEL=tiny-flux SERVE_SIZE=64x64 SERVE_NEW=48x64 \
#   SERVE_ARGS="--machines 1 --gpus-per-machine 2" TORCH_COMPILE_OVERRIDE_BACKENDS=">=0:aot_eager" \
#   bash benchmarks/serve_compile_gpu.sh
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; mkdir -p "$OUT"
MODEL=${SERVE_MODEL:-flux-dev}; SIZE=${SERVE_SIZE:-1024x1024}; NEW=${SERVE_NEW:-768x1344}
PORT=${SERVE_PORT:-8123}; URL=http://127.0.0.1:$PORT
CACHE=$OUT/inductor; rm -rf "$CACHE"
TABLE=$OUT/serve_compile.tsv
printf 'run\tready_s\tfirst_s\tsecond_s\tnew_size_s\n' > "$TABLE"
now() { date +%s.%N; }
ask() {  # seconds of one request of size $1
  curl -s -o /dev/null -w '%{time_total}' "$URL/v1/images/generations" -H "Content-Type: application/json" \
    -d "{\"prompt\": \"a red cat on a quiet street\", \"size\": \"$1\", \"seed\": 3}"
}
serve() {  # run name, then serve's extra options
  local name=$1; shift
  local started; started=$(now)
  python -m streamfusion_diffusers serve --model "$MODEL" --port "$PORT" --warm-sizes "$SIZE" ${SERVE_ARGS:-} "$@" \
    > "$OUT/$name.log" 2>&1 &
  local pid=$!
  until curl -sf "$URL/health" > /dev/null; do
    if ! kill -0 "$pid" 2> /dev/null; then echo "$name: serve exited before ready (see $OUT/$name.log)"; return 1; fi
    sleep 0.5
  done
  local ready; ready=$(python -c "print(f'{$(now) - $started:.1f}')")
  local first second new=-
  first=$(ask "$SIZE"); second=$(ask "$SIZE")
  if [ "$name" = compile_warm ]; then new=$(ask "$NEW"); fi
  curl -s "$URL/health" > "$OUT/$name.health.json"; curl -s "$URL/metrics" > "$OUT/$name.metrics.txt"
  kill -TERM "$pid"; wait "$pid"
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$ready" "$first" "$second" "$new" | tee -a "$TABLE"
}
serve eager
serve compile_cold --compile --compile-cache "$CACHE"
serve compile_warm --compile --compile-cache "$CACHE"
grep -h "compile_stall" "$OUT/compile_warm.metrics.txt" | grep -v "^#\|_created"
