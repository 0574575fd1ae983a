#!/usr/bin/env bash
# Issue 27 on one host of P GPUs (nvidia-h200-x2: P=2; nvidia-h200-x4: P=4): one part per device call, each
# within BUDGET seconds (default 540), from the project root with the wheels importable (PYTHONPATH=/tmp/site:$PWD;
# cache-dit 1.5.3 and einops carried as wheels for the Cache-DiT rows):
#   bash benchmarks/multigpu_suite.sh PART [PART ...]
# Parts (what each shows; the figures go to BENCHMARKS.md, "What waits for several GPUs"):
#   models      step of Wan 2.2 TI2V-5B (704x1280, 121 frames), Qwen-Image (1328x1328), Flux.2-dev (1024, 2048):
#               ours at auto and every UxR, diffusers CP and Cache-DiT at every UxR, eager and compiled, peak
#               GiB per GPU, error against the unparallelized step. WAITS for issue 23 (models.TRANSFORMERS,
#               models.inputs): benchmarks/models_multigpu.py imports them. One call per model: MODELS=qwen-image.
#   e2e         whole generations (text, steps, VAE) of Flux.1-dev 2048 and CogVideoX-5b 49 f: ours (auto), one
#               GPU, diffusers CP, xfuser and Cache-DiT (exact, fp8 lossy, async), peak GiB per GPU. The same
#               for the new models WAITS for their pipelines in `bench --level e2e` (issue 23: models.MODELS
#               has only flux-dev and cogvideox-5b pipelines today).
#   ring-memory (P=4) CogVideoX-5b 161 frames 768x1360, one layer and one step: ring U1R4 and torus against
#               Ulysses U4R1, peak GiB per GPU (bar: within 1.1x of U4R1) and time. The bounded K/V is issue 22's:
#               run it on the commit before that merge and after (the bar's "no slower than before").
#   fp8         emulated 2 x 1 p4de, Flux 4096 px layer: bf16 against fp8 / int8 transfers (now Hadamard-rotated),
#               time and relative error (benchmarks/vae_comm_bench.py --parts layer), then the same through
#               `bench` at layer and step level (the --comm-dtype job that exited with status 1 on 2026-11-24).
#   verify      (P=2) `verify --self-test` at real sizes, Flux 4096 px and CogVideoX 161 f, bf16: every method's
#               relative error and every injected fault caught. WAITS for issue 22 (--self-test).
# Settings: BUDGET, ITERS (default 3), MODELS (models part), OUT (default outputs), P (default: the GPUs seen),
# DRY=1 (print each command instead of running it).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; mkdir -p "$OUT"
P=${P:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
ITERS=${ITERS:-3}; end=$((SECONDS + ${BUDGET:-540}))
keep='^(\{|\||#|e2e |PASS|FAIL|MISMATCH|note|streamfusion (bench|verify)|Traceback|[A-Za-z.]*Error)'
run() {  # name, then the command; its log under $OUT, the kept lines on stdout
  local name=$1; shift
  [ -n "${DRY:-}" ] && { echo "$*"; return; }
  timeout $((end - SECONDS)) "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -E "$keep" "$OUT/$name.log" | cut -c1-300
  [ $rc -eq 0 ] || echo "FAIL $name: exit $rc (124: out of time; see $OUT/$name.log)"
}
layouts() {  # every UxR of P ranks
  local out="" u
  for u in $(seq "$P" -1 1); do [ $((P % u)) -eq 0 ] && out="$out${out:+,}U${u}R$((P / u))"; done
  echo "$out"
}
sf="python3 -m streamfusion_diffusers launch --nproc-per-node $P"

for part in "$@"; do
  case $part in
    models)
      for model in ${MODELS:-wan2.2-ti2v-5b qwen-image flux2-dev:1024 flux2-dev:2048}; do
        echo "== 1 x $P, one step of $model: ours, diffusers CP, Cache-DiT; eager and compiled"
        run "models-${model/:/-}" torchrun --nproc-per-node "$P" benchmarks/models_multigpu.py --models "$model" \
          --layouts "$(layouts)" --repeats "$ITERS" --out "$OUT/models-${model/:/-}.json"
      done ;;
    e2e)
      echo "== 1 x $P, Flux.1-dev 2048 px, whole generations, 5 steps"
      run e2e-flux $sf -m streamfusion_diffusers bench --level e2e --workloads flux-dev:2048 --steps 5 \
        --iters "$ITERS" --methods one-gpu,ours,diffusers-cp,cache-dit,cache-dit-fp8,cache-dit-async \
        --out "$OUT/e2e-flux"
      echo "== 1 x $P, CogVideoX-5b 49 frames 480x720, CFG on, whole generations, 5 steps"
      run e2e-cog $sf -m streamfusion_diffusers bench --level e2e --workloads cogvideox-5b:49:480:720 --steps 5 \
        --iters "$ITERS" --methods one-gpu,ours,ours-cfg,xfuser,cache-dit,cache-dit-fp8 --out "$OUT/e2e-cog" ;;
    ring-memory)
      [ "$P" -ge 4 ] || { echo "ring-memory needs 4 GPUs (at R = 2 two K/V blocks are the whole set)"; continue; }
      echo "== 1 x $P, CogVideoX-5b 161 frames 768x1360: ring and torus peak memory against Ulysses"
      run ring-memory $sf --recipe cogvideox-5b --frames 161 -m streamfusion_diffusers bench --level layer,step \
        --workloads cogvideox-5b:161:768:1360 --methods ulysses,ring,usp,torus --layouts U4R1,U1R4,U2R2,U4R1T4 \
        --iters "$ITERS" --warmup 1 --out "$OUT/ring-memory" ;;
    fp8)
      echo "== emulated 2 x 1 p4de, Flux 4096 px layer: bf16 against fp8 / int8 transfers"
      run fp8-layer torchrun --nproc-per-node 2 benchmarks/vae_comm_bench.py --parts layer
      for dtype in int8 fp8; do
        echo "== bench --comm-dtype $dtype, emulated 2 x 1 p4de, Flux 2048 px layer and step"
        run "bench-$dtype" torchrun --nproc-per-node 2 -m streamfusion_diffusers bench --level layer,step \
          --workloads flux-dev:2048 --machines 2 --gpus-per-machine 1 --emulate-link p4de --backend torch \
          --comm-dtype "$dtype" --methods usp,torus --iters "$ITERS" --out "$OUT/bench-$dtype"
      done ;;
    verify)
      echo "== 1 x 2, bf16, real sizes: every method's error and every injected fault caught"
      run verify-flux torchrun --nproc-per-node 2 -m streamfusion_diffusers verify --self-test --machines 1 \
        --heads 24 --head-dim 128 --seq-len 65536 --joint 512
      run verify-cog torchrun --nproc-per-node 2 -m streamfusion_diffusers verify --self-test --machines 1 \
        --heads 48 --head-dim 64 --seq-len 167280 --joint 226 ;;
    *) echo "unknown part $part: models, e2e, ring-memory, fp8, verify (see the header of $0)"; exit 2 ;;
  esac
done
