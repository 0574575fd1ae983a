#!/usr/bin/env bash
# Issues 4 and 5 on one 2-GPU host (nvidia-h200-x2): layers on NCCL and NVSHMEM, the xDiT comparison, and
# two virtual machines over emulated p4de / DGX links. Run from the project root on the device machine:
#   bash benchmarks/device_x2.sh [real|emulated]           (wheels from ../shared/device/wheels.sh carried in .whl/)
# Short tables go to stdout; everything else into $OUT/x2.tar.gz.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; work=$OUT/x2; mkdir -p "$work"
part=${1:-all}  # real | emulated | all: two calls fit the device's 10-minute limit better than one
sf="python3 -m streamfusion_diffusers"
brief() { grep -E '^\||MISMATCH|ok$|Error|error' | grep -v -- '---' ; }

if [ "$part" != emulated ]; then
echo "== layer_bench: 1x2 and 2x1 real, NCCL vs NVSHMEM, fused/auto kernel"
timeout 180 $sf launch --nproc-per-node 2 --recipe flux-dev --resolution 4096 benchmarks/layer_bench.py \
  --out "$work" --machines 1,2 --skip-check > "$work/layer.log" 2>&1
grep -E "^(flux|cog|graph)" "$work/layer.log" | grep -v vs-torch

echo "== bench: real 1x2 against xDiT USP, both transports"
for backend in torch nvshmem; do
  timeout 200 $sf launch --nproc-per-node 2 --recipe flux-dev --resolution 4096 -m streamfusion_diffusers bench \
    --workloads flux-dev:2048,flux-dev:4096,cogvideox-5b:49 --machines 1 --backend $backend --layouts all \
    --methods ulysses,usp,tas,torus,xdit-usp --iters 10 --out "$work/real-$backend" > "$work/real-$backend.log" 2>&1
  echo "-- $backend"; brief < "$work/real-$backend.log"
done

fi
if [ "$part" != real ]; then
for link in p4de dgx; do
  echo "== bench: 2 virtual machines x 1 GPU, $link link, NVSHMEM"
  timeout 240 $sf launch --nproc-per-node 2 --recipe cogvideox-5b --frames 161 --height 768 --width 1360 \
    -m streamfusion_diffusers bench --workloads flux-dev:3072,flux-dev:4096,cogvideox-5b:161 --machines 2 \
    --backend nvshmem --emulate-link $link --methods usp,tas,torus --iters 5 --warmup 2 --out "$work/emu-$link" > "$work/emu-$link.log" 2>&1
  brief < "$work/emu-$link.log"
done

echo "== emulation check, p4de"
timeout 120 torchrun --nproc-per-node 2 benchmarks/emulation_check.py --machines 2 --link p4de 2>&1 | grep -v "^\*\|OMP" | tail -8
fi
tar czf "$OUT/x2-$part.tar.gz" -C "$OUT" x2 && rm -rf "$work"
