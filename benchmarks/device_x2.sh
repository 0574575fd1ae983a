#!/usr/bin/env bash
# Issues 4 and 5 on one 2-GPU host (nvidia-h200-x2): layers on NCCL and NVSHMEM, the xDiT comparison, and
# two virtual machines over emulated p4de / DGX links. Run from the project root on the device machine:
#   bash benchmarks/device_x2.sh [layer] [real] [emulated] [step] [profile]     (default: all)
# with the wheels of ../shared/device/wheels.sh carried in .whl/. Short tables go to stdout; every log,
# table, JSON and plot into $OUT/x2.tar.gz. Each workload runs in its own job, so one failure costs one row.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; work=$OUT/x2; mkdir -p "$work"
parts=${*:-layer real emulated step profile}
sf="python3 -m streamfusion_diffusers"
table() { grep -E '^\| [a-z]|MISMATCH|Error|error:' "$1" | grep -v -- '---' | cut -c1-160; }

if [[ " $parts " == *" layer "* ]]; then
  echo "== layer_bench: 1x2 and 2x1, NCCL vs NVSHMEM, CUDA graph"
  timeout 180 $sf launch --nproc-per-node 2 --recipe flux-dev --resolution 4096 benchmarks/layer_bench.py \
    --out "$work" --machines 1,2 > "$work/layer.log" 2>&1
  grep -E "^(check|flux|cog|graph)" "$work/layer.log" | grep -v vs-torch
fi

if [[ " $parts " == *" real "* ]]; then
  echo "== bench: real 1x2, every layout, against xDiT USP"
  for backend in torch nvshmem; do
    for w in flux-dev:2048 flux-dev:4096 cogvideox-5b:49; do
      name=real-$backend-${w/:/-}
      timeout 150 $sf launch --nproc-per-node 2 --recipe flux-dev --resolution 4096 -m streamfusion_diffusers bench \
        --workloads $w --machines 1 --backend $backend --layouts all --methods ulysses,usp,tas,torus,xdit-usp \
        --iters 10 --timeout 60 --out "$work/$name" > "$work/$name.log" 2>&1
      echo "-- $backend $w rc=$?"; table "$work/$name.log"
    done
  done
fi

if [[ " $parts " == *" emulated "* ]]; then
  for link in p4de dgx; do
    echo "== bench: 2 virtual machines x 1 GPU over the $link link, NVSHMEM"
    for w in flux-dev:3072 flux-dev:4096 cogvideox-5b:161; do
      name=emu-$link-${w/:/-}
      timeout 150 $sf launch --nproc-per-node 2 --recipe cogvideox-5b --frames 161 --height 768 --width 1360 \
        -m streamfusion_diffusers bench --workloads $w --machines 2 --backend nvshmem --emulate-link $link \
        --methods usp,tas,torus --layouts all --iters 5 --warmup 2 --timeout 60 --out "$work/$name" > "$work/$name.log" 2>&1
      echo "-- $w rc=$?"; table "$work/$name.log"
    done
  done
  echo "== emulation check, p4de"
  timeout 120 torchrun --nproc-per-node 2 benchmarks/emulation_check.py --machines 2 --link p4de 2>&1 \
    | grep -v "^\*\|OMP" | tail -8
fi
if [[ " $parts " == *" step "* ]]; then
  echo "== bench: real-size Flux.1-dev block and step at 2048 px, 1x2, against diffusers' context parallelism"
  timeout 400 $sf launch --nproc-per-node 2 --recipe flux-dev --resolution 2048 -m streamfusion_diffusers bench \
    --workloads flux-dev:2048 --level block,step --machines 1 --backend nvshmem --layouts U2R1,U1R2,U2R1T2 \
    --methods ulysses,usp,tas,torus,diffusers-cp --iters 5 --warmup 2 --timeout 200 --out "$work/step" \
    > "$work/step.log" 2>&1
  echo "-- rc=$?"; table "$work/step.log"
fi

if [[ " $parts " == *" profile "* ]]; then
  echo "== profile: one Flux 2048 px layer, 1x2"
  for spec in "torus nvshmem" "ulysses torch"; do
    set -- $spec
    timeout 100 $sf launch --nproc-per-node 2 --recipe flux-dev --resolution 2048 benchmarks/profile_layer.py \
      --workload flux-2048 --method $1 --backend $2 2>&1 | grep -E "^(flux|  )"
  done
fi
tar czf "$OUT/x2.tar.gz" -C "$OUT" x2 && rm -rf "$work"
