#!/usr/bin/env bash
# One GPU, the bar of "fast by default" at P = 1: `generate` with default flags (CUDA graphs), with --no-cuda-graph
# and with --compile at flux-dev 1024 (8 steps), beside plain diffusers eager and regionally compiled
# (benchmarks/p1_overhead.py, the transformer forward alone); and `--deterministic` twice, compared pixel by pixel.
# Logs and tables under $OUT. Run from the project root on one GPU: bash benchmarks/p1_default_gpu.sh
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; mkdir -p "$OUT"
MODEL=${GEN_MODEL:-flux-dev}; SIZE=${GEN_SIZE:-1024}
work=$(mktemp -d)
gen() { name=$1; shift; echo "=== $name: $*" >> "$OUT/p1_default.log"
  timeout 240 python -m streamfusion_diffusers generate --model "$MODEL" --height "$SIZE" --width "$SIZE" \
    --output "$work/$name" "$@" >> "$OUT/p1_default.log" 2>&1; echo "exit $?" >> "$OUT/p1_default.log"; }
gen default --steps 8
gen eager --steps 8 --no-cuda-graph
gen compile --steps 8 --compile
gen det1 --steps 4 --deterministic --seed 7
gen det2 --steps 4 --deterministic --seed 7
timeout 300 python benchmarks/p1_overhead.py --models "$MODEL" --modes eager,blocks --label p1 \
  > "$OUT/p1_overhead.log" 2>&1; echo "exit $?" >> "$OUT/p1_overhead.log"
cp p1_overhead_p1.json "$OUT/" 2>/dev/null
python - "$work" "$OUT/p1_default.json" <<'PY' | tee -a "$OUT/p1_default.log"
import json, pathlib, statistics, sys
import numpy as np
from PIL import Image
work, runs = pathlib.Path(sys.argv[1]), {}
for path in sorted(work.glob("*/run.json")):
    r = json.loads(path.read_text()); steps = r["step_latency_s"]
    runs[path.parent.name] = {"steps_s": steps, "median_after_first_s": statistics.median(steps[1:]),
                              "phases_s": r["phases_s"], "cuda_graph": r.get("cuda_graph"), "compile": r.get("compile")}
    print(f"{path.parent.name:8s} median step after the first {1e3 * runs[path.parent.name]['median_after_first_s']:7.1f} ms  first {1e3 * steps[0]:7.1f} ms")
images = [np.asarray(Image.open(next((work / d).glob("*.png"))), dtype=np.int16) for d in ("det1", "det2")
          if list((work / d).glob("*.png"))]
if len(images) == 2:
    diff = np.abs(images[0] - images[1])
    runs["deterministic"] = {"max_diff": int(diff.max()), "pixels_differing": float((diff.max(-1) > 0).mean())}
    print("deterministic twice:", runs["deterministic"])
pathlib.Path(sys.argv[2]).write_text(json.dumps(runs, indent=2))
PY
