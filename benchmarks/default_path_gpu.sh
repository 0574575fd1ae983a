#!/usr/bin/env bash
# "Fast by default", measured the way a user meets it: `streamfusion generate` with default flags (CUDA graphs on
# by default on GPUs) against --no-cuda-graph, at P = 4, 2 and 1 on one machine, flux-dev 1024 x 1024 (override:
# GEN_MODEL, GEN_SIZE, GEN_STEPS, GEN_PS). Every run's run.json goes into $OUT/default_path.json (step latencies,
# phases, what the graphs did), and every log into $OUT/default_path.log.
# Run from the project root on 4 GPUs: bash benchmarks/default_path_gpu.sh
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-outputs}; mkdir -p "$OUT"
MODEL=${GEN_MODEL:-flux-dev}; SIZE=${GEN_SIZE:-1024}; STEPS=${GEN_STEPS:-8}
work=$(mktemp -d)
for p in ${GEN_PS:-4 1 2}; do
  gpus=$(seq -s, 0 $((p - 1)))
  for flags in "" "--no-cuda-graph"; do
    name="p${p}${flags:+-eager}"
    echo "=== $name: generate --model $MODEL --height $SIZE --width $SIZE --steps $STEPS $flags" | tee -a "$OUT/default_path.log"
    start=$SECONDS
    CUDA_VISIBLE_DEVICES=$gpus timeout 300 python -m streamfusion_diffusers generate --model "$MODEL" --height "$SIZE" \
      --width "$SIZE" --steps "$STEPS" --output "$work/$name" $flags 2>&1 | grep -v Warning | tail -8 | tee -a "$OUT/default_path.log"
    echo "wall $((SECONDS - start)) s" | tee -a "$OUT/default_path.log"
  done
done
python - "$work" "$OUT/default_path.json" <<'PY'
import json, pathlib, statistics, sys
runs = {}
for path in sorted(pathlib.Path(sys.argv[1]).glob("*/run.json")):
    r = json.loads(path.read_text())
    steps = r["step_latency_s"]
    runs[path.parent.name] = {"layout": r["layout"], "steps_s": steps, "median_after_first_s": statistics.median(steps[1:]) if len(steps) > 1 else None,
                              "phases_s": r["phases_s"], "build_s": r["build_s"], "cuda_graph": r["cuda_graph"],
                              "one_time_s": r.get("one_time_s")}
    print(f"{path.parent.name:10s} {r['layout']:12s} median step after the first {1e3 * (runs[path.parent.name]['median_after_first_s'] or 0):7.1f} ms  "
          f"first {1e3 * steps[0]:7.1f} ms  denoising {r['phases_s']['denoising']:.2f} s  graphs {r['cuda_graph']}  "
          f"one-time {r.get('one_time_s')}")
pathlib.Path(sys.argv[2]).write_text(json.dumps(runs, indent=2))
PY
