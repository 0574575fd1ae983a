#!/usr/bin/env bash
# Issue 10 on one GPU host of P GPUs: `streamfusion tune` on the real 1 x P and on emulated machines, then the
# bar check in the same call: `bench --methods auto,<ours>,xdit-usp --layouts all --recipe <what tune wrote>`.
# Run from the project root on the device machine (x2: about 7 minutes), wheels carried in .whl/ if any:
#   bash benchmarks/tune_suite.sh [--top K] [--iters N] [--warmup N] [--backend torch|nvshmem] [--budget SECONDS]
#                                 [--no-bar]
# --iters / --warmup apply to tune and to the bar alike (default: bench's and tune's shared defaults), so that
# both time every case the same way (timing.py).
# Shapes: real 1 x P; emulated N x P/N for every divisor N > 1 of P (x2: 2 x 1; x4: 2 x 2, 4 x 1) over the p4de
# and dgx presets. Workloads: Flux 1024/2048/3072/4096 px, CogVideoX 49/161 frames (env TUNE_WORKLOADS, BAR_WORKLOADS,
# BAR_EMULATED_WORKLOADS). Bar:
# Flux 1024/2048/4096 and CogVideoX 49 on 1 x P, Flux 4096 on P x 1 p4de (there without xdit-usp, which does
# not go through the emulated link), one bench job per workload. Steps run in the order the bar needs them (the
# dgx tunes last) and a step that would pass --budget (default 450 s) is skipped and said so.
# Outputs under $OUT: recipes/ (<model>.yaml, measurements.json: what `tune --merge-into` takes), bar/<job>/
# (bench's table.md, results.json), logs/. Stdout: one line per step, tune's chosen layouts, PASS/FAIL lines.
set -u
top=6 iters=10 warmup=3 backend=torch budget=450 bar=1
while [ $# -gt 0 ]; do
  case $1 in
    --top) top=$2; shift 2 ;; --iters) iters=$2; shift 2 ;; --warmup) warmup=$2; shift 2 ;;
    --backend) backend=$2; shift 2 ;; --budget) budget=$2; shift 2 ;;
    --no-bar) bar=0; shift ;;
    *) echo "unknown option $1 (see the header of $0)"; exit 2 ;;
  esac
done
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-outputs/tune-suite}; recipes=$OUT/recipes; mkdir -p "$recipes" "$OUT/bar" "$OUT/logs"
P=${GPUS:-$(nvidia-smi -L | wc -l)}
WORKLOADS=${TUNE_WORKLOADS:-flux-dev:1024,2048,3072,4096,cogvideox-5b:49,161}
BAR_REAL=${BAR_WORKLOADS:-flux-dev:1024 flux-dev:2048 flux-dev:4096 cogvideox-5b:49}
BAR_EMULATED=${BAR_EMULATED_WORKLOADS:-flux-dev:4096}
xdit=${BAR_BASELINE-,xdit-usp}  # empty where yunchang is not installed (CPU smoke tests)
ours=ulysses,ring,usp,tas,torus
# every job under torchrun, NVSHMEM's heap sized for the largest layer (CogVideoX 161 frames)
sf="python3 -m streamfusion_diffusers"
run="$sf launch --nproc-per-node $P --model cogvideox-5b --frames 161 -m streamfusion_diffusers"
start=$SECONDS
fits() {  # fits SECONDS: whether a step of about that long still fits the budget
  [ $((SECONDS - start + $1)) -le "$budget" ] && return 0
  echo "   skipped: $((SECONDS - start)) s used of $budget"; return 1
}
tune() {  # tune N M LINK ESTIMATE_S
  local n=$1 m=$2 link=$3 name=tune-$1x$2-$3
  echo "== tune $n x $m ($link link), top $top, $iters iterations [$((SECONDS - start)) s]"
  fits "$4" || return
  local emulate=(); [ "$link" != real ] && emulate=(--emulate-link "$link")
  timeout $((budget - SECONDS + start)) $run tune --workloads "$WORKLOADS" --machines "$n" --gpus-per-machine "$m" \
    "${emulate[@]}" --backend "$backend" --top "$top" --iters "$iters" --warmup "$warmup" --timeout 120 \
    --out "$recipes" > "$OUT/logs/$name.log" 2>&1
  echo "   rc=$?"; grep -E " ms \[" "$OUT/logs/$name.log" | cut -c1-150
  grep -m1 -E "Error|error:" "$OUT/logs/$name.log" | tr '\r' '\n' | tail -1 | cut -c1-200
}
check() {  # check N M LINK WORKLOAD METHODS ESTIMATE_S
  local n=$1 m=$2 link=$3 w=$4 name=bar-$1x$2-$3-${4//:/-}
  echo "== bar $w on $n x $m ($link) [$((SECONDS - start)) s]"
  ls "$recipes"/*.yaml > /dev/null 2>&1 || { echo "   skipped: tune wrote no recipe"; return; }
  fits "$6" || return
  local emulate=(); [ "$link" != real ] && emulate=(--emulate-link "$link")
  timeout $((budget - SECONDS + start)) $run bench --workloads "$w" --machines "$n" --gpus-per-machine "$m" \
    "${emulate[@]}" --backend "$backend" --methods "$5" --layouts all --recipe "$recipes" --iters "$iters" \
    --warmup "$warmup" --timeout 120 --out "$OUT/bar/$name" > "$OUT/logs/$name.log" 2>&1
  echo "   rc=$?"; grep -E "^(PASS|FAIL|MISMATCH)" "$OUT/logs/$name.log" | cut -c1-200
  grep -m1 -E "Error|error:" "$OUT/logs/$name.log" | tr '\r' '\n' | tail -1 | cut -c1-200
}
echo "P=$P backend=$backend workloads=$WORKLOADS budget=${budget}s"
tune 1 "$P" real 70
for n in $(seq 2 "$P"); do [ $((P % n)) -eq 0 ] && tune "$n" $((P / n)) p4de 80; done
if [ "$bar" = 1 ]; then
  for w in $BAR_REAL; do check 1 "$P" real "$w" "auto,$ours$xdit" 45; done
  for w in $BAR_EMULATED; do check "$P" 1 p4de "$w" "auto,$ours" 50; done
fi
for n in $(seq 2 "$P"); do [ $((P % n)) -eq 0 ] && tune "$n" $((P / n)) dgx 70; done
count() { cat "$OUT"/logs/bar-*.log 2>/dev/null | grep -cE "^$1"; }
echo "== done in $((SECONDS - start)) s; bar: $(count PASS) PASS, $(count FAIL) FAIL; recipes in $recipes"
$sf tune --report "$recipes/measurements.json" > "$OUT/predictions.md" 2>&1
grep -E "^###|^Fitted|rror" "$OUT/predictions.md" | cut -c1-300  # the table itself: $OUT/predictions.md
