#!/usr/bin/env bash
# Issues 4 and 5 on one GPU host of P GPUs (nvidia-h200-x2, -x4, -x8): layers on NCCL and NVSHMEM, the xDiT
# comparison, block and step against diffusers, N virtual machines over emulated links, a layer profile.
# Run from the project root on the device machine, with ../shared/device/wheels.sh's wheels carried in .whl/:
#   bash benchmarks/device_suite.sh [gputests] [auto] [layer] [real] [emulated] [step] [profile]
#   (default: layer real emulated step profile; one 10-minute device call fits about two parts on x2, one on x8)
# Settings (environment): GPUS (default: all visible), MACHINES (virtual machine counts for `emulated`, default
# every divisor of P in 2 .. P/2, or 2 when P = 2), LINKS (default "p4de dgx"), REAL_WORKLOADS,
# EMU_WORKLOADS, STEP_WORKLOADS, AUTO_WORKLOADS (space-separated bench workloads), RECIPE (where method auto looks). Short tables go to stdout; every log, table,
# JSON and plot into $OUT/suite.tar.gz. Each workload runs in its own job, so one failure costs one row.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; work=$OUT/suite; mkdir -p "$work"
parts=${*:-layer real emulated step profile}
P=${GPUS:-$(nvidia-smi -L | wc -l)}
if [ -z "${MACHINES:-}" ]; then
  MACHINES=""; for n in $(seq 2 $((P / 2))); do [ $((P % n)) -eq 0 ] && MACHINES="$MACHINES $n"; done
  [ "$P" -eq 2 ] && MACHINES=2
fi
LINKS=${LINKS:-p4de dgx}
REAL_WORKLOADS=${REAL_WORKLOADS:-flux-dev:2048 flux-dev:4096 cogvideox-5b:49}
EMU_WORKLOADS=${EMU_WORKLOADS:-flux-dev:3072 flux-dev:4096 cogvideox-5b:161 cogvideox-5b:321}
STEP_WORKLOADS=${STEP_WORKLOADS:-flux-dev:2048 flux-dev:4096}
sf="python3 -m streamfusion_diffusers"
launch="$sf launch --nproc-per-node $P"
heap="--model cogvideox-5b --frames 321 --height 768 --width 1360"  # the largest layer any part runs
table() { grep -E '^\| [a-z]|MISMATCH|Error|error:' "$1" | grep -v -- '---' | cut -c1-160; }
echo "P=$P machines for emulation: $MACHINES; links: $LINKS"

if [[ " $parts " == *" gputests "* ]]; then
  echo "== GPU tests (pytest -m gpu)"
  timeout 300 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -12
fi

if [[ " $parts " == *" auto "* ]]; then
  AUTO_WORKLOADS=${AUTO_WORKLOADS:-flux-dev:1024 flux-dev:2048 flux-dev:4096 cogvideox-5b:49}
  echo "== bench: method auto against every layout of ours and xDiT's USP, real 1x$P, one job per workload"
  for w in $AUTO_WORKLOADS; do
    name=auto-${w/:/-}
    timeout 200 $launch $heap -m streamfusion_diffusers bench --workloads $w --machines 1 ${RECIPE:+--recipe $RECIPE} \
      --layouts all --methods auto,ulysses,ring,usp,tas,torus,xdit-usp --iters 10 --timeout 60 --out "$work/$name" \
      > "$work/$name.log" 2>&1
    echo "-- $w rc=$?"; table "$work/$name.log"; grep -E "PASS|FAIL" "$work/$name.log" | head -3
  done
  name=auto-emu-${P}x1-p4de-flux-dev-4096
  timeout 200 $launch $heap -m streamfusion_diffusers bench --workloads flux-dev:4096 --machines $P \
    --emulate-link p4de ${RECIPE:+--recipe $RECIPE} --layouts all --methods auto,usp,tas,torus --iters 5 --warmup 2 \
    --timeout 120 --out "$work/$name" > "$work/$name.log" 2>&1
  echo "-- emulated ${P}x1 p4de flux-dev:4096 rc=$?"; table "$work/$name.log"; grep -E "PASS|FAIL" "$work/$name.log" | head -3
fi

if [[ " $parts " == *" layer "* ]]; then
  echo "== layer_bench: every machine shape, NCCL vs NVSHMEM, CUDA graph"
  timeout 300 $launch --model flux-dev --resolution 4096 benchmarks/layer_bench.py --out "$work" \
    --machines "1,$(echo $MACHINES | tr ' ' ',')" > "$work/layer.log" 2>&1
  grep -E "^(check|flux|cog|graph)" "$work/layer.log" | grep -v vs-torch
fi

if [[ " $parts " == *" real "* ]]; then
  echo "== bench: real 1x$P, every layout, against xDiT USP"
  for backend in torch nvshmem; do
    for w in $REAL_WORKLOADS; do
      name=real-$backend-${w/:/-}
      timeout 200 $launch $heap -m streamfusion_diffusers bench --workloads $w --machines 1 --backend $backend \
        --layouts all --methods ulysses,usp,tas,torus,xdit-usp --iters 10 --timeout 60 --out "$work/$name" \
        > "$work/$name.log" 2>&1
      echo "-- $backend $w rc=$?"; table "$work/$name.log"
    done
  done
fi

if [[ " $parts " == *" emulated "* ]]; then
  for n in $MACHINES; do
    for link in $LINKS; do
      echo "== bench: $n virtual machines x $((P / n)) GPUs over the $link link, NVSHMEM"
      for w in $EMU_WORKLOADS; do
        name=emu-${n}x$((P / n))-$link-${w/:/-}
        timeout 300 $launch $heap -m streamfusion_diffusers bench --workloads $w --machines $n --backend nvshmem \
          --emulate-link $link --methods usp,tas,torus --layouts all --iters 5 --warmup 2 --timeout 120 \
          --out "$work/$name" > "$work/$name.log" 2>&1
        echo "-- $w rc=$?"; table "$work/$name.log"
      done
    done
    echo "== emulation check, $n machines, p4de"
    timeout 120 torchrun --nproc-per-node $P benchmarks/emulation_check.py --machines $n --link p4de 2>&1 \
      | grep -v "^\*\|OMP" | tail -8
  done
fi

if [[ " $parts " == *" step "* ]]; then
  for w in $STEP_WORKLOADS; do
    echo "== bench: real-size block and step, $w, 1x$P, against diffusers' context parallelism"
    name=step-${w/:/-}
    timeout 500 $launch $heap -m streamfusion_diffusers bench --workloads $w --level block,step --machines 1 \
      --backend nvshmem --methods ulysses,usp,tas,torus,diffusers-cp ${STEP_LAYOUTS:+--layouts $STEP_LAYOUTS} \
      --iters 5 --warmup 2 --timeout 200 --out "$work/$name" > "$work/$name.log" 2>&1
    echo "-- rc=$?"; table "$work/$name.log"
  done
fi

if [[ " $parts " == *" profile "* ]]; then
  echo "== profile: one Flux 2048 px layer, 1x$P"
  for spec in "torus nvshmem" "ulysses torch"; do
    set -- $spec
    timeout 100 $launch --model flux-dev --resolution 2048 benchmarks/profile_layer.py \
      --workload flux-2048 --method $1 --backend $2 2>&1 | grep -E "^(flux|  )"
  done
fi
tar czf "$OUT/suite.tar.gz" -C "$OUT" suite && rm -rf "$work"
