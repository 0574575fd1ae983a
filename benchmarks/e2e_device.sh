#!/usr/bin/env bash
# Issue 14 on nvidia-h200-x2 (2 GPUs), within BUDGET seconds (default 470): the emulated 2 x 1 p4de Flux 4096 px
# layer with bf16 / fp8 / int8 transfers, then whole generations (`streamfusion bench --level e2e`, real-size
# pipelines with random weights, STEPS denoising steps, one warm-up then ITERS timed generations per system):
# Flux.1-dev 2048 px (ours, ours without the VAE split, one GPU, diffusers' CP at U2R1 and U1R2) and CogVideoX-5b
# 49 frames 480x720 with CFG (ours, ours with CFG parallel, one GPU, xfuser --use_cfg_parallel and U2R1).
# Run from the project root with the wheels importable (PYTHONPATH=/tmp/site:$PWD):
#   bash benchmarks/e2e_device.sh [layer] [flux] [cogvideox] [emulated]   (default: the first three, in order)
# emulated (a second call: about 4 minutes): CogVideoX on 2 x 1 over an emulated p4de link, ours with bf16 and
# with fp8 inter-machine transfers, and ours with CFG parallel (one guidance branch per machine), against one GPU.
# Settings: ITERS (default 2), STEPS (default 5), BUDGET. Each part gets what the earlier ones left of BUDGET;
# short tables to stdout, every log, table.md and results.json under $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; mkdir -p "$OUT"
parts=${*:-layer flux cogvideox}
ITERS=${ITERS:-2}; STEPS=${STEPS:-5}; end=$((SECONDS + ${BUDGET:-470}))
keep='^(\||#|e2e |flux-dev|cogvideox-5b|MISMATCH|note|PASS|FAIL|streamfusion bench|Traceback|[A-Za-z.]*Error)'
e2e="-m streamfusion_diffusers bench --level e2e --steps $STEPS --iters $ITERS"
part() {  # name, then the torchrun arguments
  local name=$1; shift
  timeout $((end - SECONDS)) torchrun --nproc-per-node 2 "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -E "$keep" "$OUT/$name.log" | cut -c1-200
  [ $rc -eq 0 ] || echo "FAIL $name: exit $rc (124: out of time; see $OUT/$name.log)"
}

if [[ " $parts " == *" layer "* ]]; then
  echo "== emulated 2 x 1 p4de, one Flux 4096 px layer: bf16 against fp8 / int8 inter-machine transfers"
  part layer-fp8 benchmarks/vae_comm_bench.py --parts layer
fi
if [[ " $parts " == *" flux "* ]]; then
  echo "== Flux.1-dev 2048 px, whole generations: ours against one GPU and diffusers' context parallelism"
  part e2e-flux $e2e --workloads flux-dev:2048 --methods one-gpu,ours,ours-no-vae-split,diffusers-cp \
    --out "$OUT/e2e-flux"
fi
if [[ " $parts " == *" cogvideox "* ]]; then
  echo "== CogVideoX-5b 49 frames 480x720, CFG on, whole generations: ours against one GPU and xfuser"
  part e2e-cogvideox $e2e --workloads cogvideox-5b:49:480:720 --methods one-gpu,ours,ours-cfg,xfuser \
    --layouts xfuser:cfg2U1R1,xfuser:U2R1 --out "$OUT/e2e-cogvideox"
fi
if [[ " $parts " == *" emulated "* ]]; then
  emu="--workloads cogvideox-5b:49:480:720 --machines 2 --gpus-per-machine 1 --emulate-link p4de"
  echo "== CogVideoX-5b 49 frames, 2 x 1 over an emulated p4de link: bf16 transfers, CFG parallel, one GPU"
  part e2e-emu-bf16 $e2e $emu --methods one-gpu,ours,ours-cfg --out "$OUT/e2e-emu-bf16"
  echo "== the same with fp8 inter-machine transfers"
  part e2e-emu-fp8 $e2e $emu --methods ours --comm-dtype fp8 --out "$OUT/e2e-emu-fp8"
fi
