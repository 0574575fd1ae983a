#!/usr/bin/env bash
# One GPU: the quantized paths against bf16 at P = 1, per model at its real size, in one job: `generate` with
# default flags, --compile, --quantize fp8-dynamic, --attention int8 and fp8, and the fastest stack (compile +
# fp8-dynamic + int8 attention); each one's median step after the first, and the PSNR and relative error of its
# image against the default bf16 one (same seed); plain diffusers eager and compiled beside them, in bf16 and
# with torchao fp8-dynamic (benchmarks/p1_overhead.py). The GPU tests of the paths first. Logs and quantized_p1.json under $OUT.
# Run from the project root on one GPU: bash benchmarks/quantized_p1_gpu.sh ["MODEL SIZE STEPS" ...]
# (default: flux-dev 1024 and qwen-image 1328); QUANTIZED_TESTS=0 skips the tests, QUANTIZED_RUNS names the runs,
# QUANTIZED_WORK keeps their outputs (a temporary folder otherwise).
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; mkdir -p "$OUT"
[ "${QUANTIZED_TESTS:-1}" = 1 ] && { timeout 200 python -m pytest -m gpu -x -q tests/test_kernels_gpu.py -k quantized 2>&1 | tail -5
  timeout 300 python -m pytest -m gpu -x -q tests/test_compiled.py -k captured 2>&1 | tail -10; } \
  > "$OUT/quantized_tests.log"
work=${QUANTIZED_WORK:-$(mktemp -d)}; mkdir -p "$work"
specs=("$@"); [ ${#specs[@]} -gt 0 ] || specs=("flux-dev 1024 8" "qwen-image 1328 6")
runs=${QUANTIZED_RUNS:-bf16 compile fp8-dynamic int8-attention fp8-attention fastest}
declare -A FLAGS=([bf16]="" [compile]="--compile" [fp8-dynamic]="--quantize fp8-dynamic"
  [int8-attention]="--attention int8" [fp8-attention]="--attention fp8"
  [fastest]="--compile --quantize fp8-dynamic --attention int8")
for spec in "${specs[@]}"; do
  read -r model size steps <<< "$spec"
  gen() { name=$model-$1; shift; echo "=== $name: $*" >> "$OUT/quantized_p1.log"
    timeout 300 python -m streamfusion_diffusers generate --model "$model" --height "$size" --width "$size" \
      --steps "$steps" --seed 3 --output "$work/$name" "$@" 2>&1 | tr '\r' '\n' | grep -v -E "(it/s|s/it)\]" \
      >> "$OUT/quantized_p1.log"; }
  # shellcheck disable=SC2086
  for run in $runs; do gen "$run" ${FLAGS[$run]}; done
  if [ "${QUANTIZED_PLAIN:-1}" = 1 ]; then  # plain diffusers beside ours: bf16, then both with torchao fp8-dynamic
    timeout 300 python benchmarks/p1_overhead.py --models "$model" --modes eager,blocks --label "$model" \
      >> "$OUT/p1_overhead.log" 2>&1
    timeout 300 python benchmarks/p1_overhead.py --models "$model" --modes eager,blocks --quantize fp8-dynamic \
      --label "$model-fp8-dynamic" >> "$OUT/p1_overhead.log" 2>&1
  fi
done
python - "$work" "$OUT/quantized_p1.json" <<'PY' | tee -a "$OUT/quantized_p1.log"
import json, math, pathlib, statistics, sys
import numpy as np
from PIL import Image
work, rows = pathlib.Path(sys.argv[1]), {}
for path in sorted(work.glob("*/run.json")):
    run, name = json.loads(path.read_text()), path.parent.name
    png = next(path.parent.glob("*.png"), None)
    rows[name] = {"median_step_s": statistics.median(run["step_latency_s"][1:]), "png": str(png) if png else None,
                  "attention": run.get("attention_precision"), "stack": run.get("stack")}
for name, row in rows.items():
    base = next((r for n, r in rows.items() if n.endswith("-bf16") and name.startswith(n[:-5])), None)
    if base and row["png"] and base["png"]:
        a = np.asarray(Image.open(row["png"]), dtype=np.float64); b = np.asarray(Image.open(base["png"]), dtype=np.float64)
        mse = float(((a - b) ** 2).mean())
        row["psnr_db"] = math.inf if mse == 0 else 10 * math.log10(255 ** 2 / mse)
        row["image_rel_err"] = float(np.linalg.norm(a - b) / np.linalg.norm(b))
        row["step_vs_bf16"] = row["median_step_s"] / base["median_step_s"]
    print(f"{name:28s} {1e3 * row['median_step_s']:8.1f} ms  x{row.get('step_vs_bf16', 1):.3f}  "
          f"PSNR {row.get('psnr_db', float('nan')):6.1f} dB")
pathlib.Path(sys.argv[2]).write_text(json.dumps(rows, indent=2))
PY
