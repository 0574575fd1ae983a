#!/usr/bin/env bash
# The new models' whole pipelines, real size with random weights, `streamfusion generate --steps 2` on one GPU:
# one line per model (wall, build, mean step, peak memory, VAE decode) to stdout and $OUT/new_models.txt, each
# run's run.json under $OUT/<model>/. Sizes below the defaults where a whole default video takes minutes:
# Wan 2.2 TI2V-5B at its 704x1280 with 17 frames, A14B at 480x832 with 17 frames (said in each line).
# Usage (device): bash benchmarks/new_models_gpu.sh   (about 6 minutes on one H200)
set -u
OUT=${OUT:-outputs/new-models}
mkdir -p "$OUT"
run() {  # model, then generate's size options
  local model=$1; shift
  local start=$(date +%s.%N)
  python -m streamfusion_diffusers generate --model "$model" --steps 2 --output "$OUT/$model" "$@" \
    > "$OUT/$model.log" 2>&1
  local rc=$? wall=$(echo "$(date +%s.%N) - $start" | bc)
  python - "$OUT/$model/run.json" "$model" "$rc" "$wall" "$*" <<'PY' | tee -a "$OUT/new_models.txt"
import json, sys
path, model, rc, wall, size = sys.argv[1:]
if rc != "0":
    print(f"{model}: FAILED (exit {rc}), see {path.rsplit('/', 2)[0]}/{model}.log")
    sys.exit()
r = json.load(open(path))
steps = r["step_latency_s"]
frames = f"x{r['frames']}f" if r["frames"] else ""
print(f"{model} {r['height']}x{r['width']}{frames}: wall {float(wall):.1f} s (build {r['build_s']:.1f} s), "
      f"step {1e3 * sum(steps) / len(steps):.0f} ms (cfg calls/step: {'2' if r['guidance_scale'] and "
      f"r['guidance_scale'] > 1 and model.startswith('wan') else '1'}), peak {r['peak_memory_gib']:.1f} GiB, "
      f"vae_decode {r['vae_decode']}, encoded_first {r['encoded_first']}, phases "
      + ", ".join(f"{k} {v:.2f} s" for k, v in r["phases_s"].items()))
PY
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/new_models.txt"
run qwen-image
run wan2.2-ti2v-5b --frames 17
run wan2.2-t2v-a14b --height 480 --width 832 --frames 17
run flux2-dev
