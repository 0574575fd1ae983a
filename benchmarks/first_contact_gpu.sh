#!/usr/bin/env bash
# Issue 24 on one GPU (nvidia-h100-x1 or nvidia-h200), in under 6 minutes: `streamfusion generate` on a real-size
# model with no launcher runs on the GPU (one NCCL process per visible GPU, as torchrun would start them) and
# writes its image and run.json; the same command with a bad option ends in one line before anything starts.
# Run from the project root with the wheels of ../shared/device/wheels.sh carried in .whl/ (diffusers):
#   bash benchmarks/first_contact_gpu.sh          (run.json and the logs go to $OUT)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; mkdir -p "$OUT"
sf="python3 -m streamfusion_diffusers"
nvidia-smi -L

echo "== streamfusion generate --model flux-dev --height 1024 --width 1024 --steps 2 (no launcher)"
start=$SECONDS
timeout 300 $sf generate --model flux-dev --height 1024 --width 1024 --steps 2 --output /tmp/first-contact \
  > "$OUT/generate.log" 2>&1
echo "exit $? after $((SECONDS - start)) s; its output:"
cut -c1-300 "$OUT/generate.log" | tail -8
ls -l /tmp/first-contact
cp /tmp/first-contact/run.json "$OUT/run.json" && python3 - "$OUT/run.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print({k: r[k] for k in ("device", "world_size", "backend", "layout", "output_size", "build_s", "total_s")})
PY

echo "== the same with a bad option (--height 1000)"
start=$SECONDS
$sf generate --model flux-dev --height 1000 --width 1024 --steps 2 > "$OUT/bad.log" 2>&1
echo "exit $? after $((SECONDS - start)) s, $(wc -l < "$OUT/bad.log") line(s):"
cat "$OUT/bad.log"
