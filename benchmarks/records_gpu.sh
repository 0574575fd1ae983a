#!/usr/bin/env bash
# Issue 34 item 5 on one GPU (nvidia-h100-x1 or nvidia-h200): re-take the one-GPU figures of BENCHMARKS.md whose
# output was not kept (their sections say "no record"), so that each gets its record. One part per device call
# (each within 9 minutes), from the project root with diffusers importable:
#   bash benchmarks/records_gpu.sh PART [PART ...]
# Parts, and the BENCHMARKS.md section each one's record belongs to:
#   models      "every diffusers model with a context-parallel plan": the new models' forwards at P = 1 (5 min)
#   vae         "the VAE decode over ranks for Wan 2.x, Qwen-Image and Flux.2": each decode strategy, 49 frames
#   exactness   "exactness": honest bfloat16 errors of the kernels at Flux 4096 and CogVideoX 49 f (2 min)
# Every part writes its JSON and log under $OUT/<part>/; copy $OUT to benchmarks/results/<date>-<kind>-records/
# and cite it in the section. Settings: OUT (default outputs), DRY=1 (print each command instead of running it).
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}
run() {  # part, then the command; its log under $OUT/<part>/, the JSON lines and errors on stdout
  local part=$1; shift
  [ -n "${DRY:-}" ] && { echo "$part: $*"; return; }
  mkdir -p "$OUT/$part"
  timeout 540 "$@" > "$OUT/$part/$part.log" 2>&1
  local rc=$?
  grep -E '^\{|Error|error' "$OUT/$part/$part.log" | cut -c1-300
  [ $rc -eq 0 ] || echo "FAIL $part: exit $rc (124: out of time; see $OUT/$part/$part.log)"
}
[ $# -gt 0 ] || { echo "usage: bash benchmarks/records_gpu.sh models|vae|exactness ..." >&2; exit 2; }
for part in "$@"; do
  case $part in
    models) run models torchrun --nproc-per-node 1 benchmarks/models_gpu.py --out "$OUT/models/models_gpu.json" ;;
    vae) run vae torchrun --nproc-per-node 1 benchmarks/vae_new_gpu.py --frames 49 --out "$OUT/vae" ;;
    exactness) run exactness python3 benchmarks/exactness_gpu.py --out "$OUT/exactness" ;;
    *) echo "unknown part $part: models, vae or exactness" >&2; exit 2 ;;
  esac
done
