#!/usr/bin/env bash
# The new models' whole pipelines, real size with random weights: `streamfusion generate --steps 2` on one GPU,
# one line per model (wall, build, mean step, peak memory, how the VAE decoded) to stdout and
# $OUT/new_models.txt, each run's run.json and log under $OUT/<model>/. Sizes below the defaults where a whole
# default video takes minutes (said in each line): Wan 2.2 TI2V-5B at its 704x1280 with 17 frames instead of
# 121, A14B at 480x832 with 17 frames instead of 720x1280x81. Flux.2-dev encodes its prompt first (24B Mistral),
# frees the encoder, then builds the 32B transformer (encoded_first).
# Usage (one GPU): bash benchmarks/new_models_gpu.sh [model ...]   (about 2 minutes on one H200 for all four)
set -u
OUT=${OUT:-outputs/new-models}
mkdir -p "$OUT"
models=("$@")
[ ${#models[@]} -eq 0 ] && models=(qwen-image wan2.2-ti2v-5b wan2.2-t2v-a14b flux2-dev)
declare -A SIZE=([wan2.2-ti2v-5b]="--frames 17" [wan2.2-t2v-a14b]="--height 480 --width 832 --frames 17")
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | tee -a "$OUT/new_models.txt"
for model in "${models[@]}"; do
  mkdir -p "$OUT/$model"
  start=$(date +%s.%N)
  # shellcheck disable=SC2086
  python3 -m streamfusion_diffusers generate --model "$model" --steps 2 --output "$OUT/$model" ${SIZE[$model]:-} \
    > "$OUT/$model/log.txt" 2>&1
  rc=$?
  python3 - "$OUT/$model" "$model" "$rc" "$start" <<'PY' | tee -a "$OUT/new_models.txt"
import json, sys, time
folder, model, rc, start = sys.argv[1:]
wall = time.time() - float(start)
if rc != "0":
    tail = open(f"{folder}/log.txt").read().strip().splitlines()[-1:]
    print(f"{model}: FAILED (exit {rc}) after {wall:.0f} s: {tail}")
    sys.exit()
r = json.load(open(f"{folder}/run.json"))
steps, peak = r["step_latency_s"], r["peak_memory_gib"]
size = f"{r['height']}x{r['width']}" + (f"x{r['frames']}f" if r["frames"] else "")
print(f"{model} {size}: wall {wall:.1f} s (build {r['build_s']:.1f} s, generate {r['generate_s']:.1f} s), "
      f"step {1e3 * sum(steps) / len(steps):.0f} ms (mean of {len(steps)}), "
      f"peak {'-' if peak is None else f'{peak:.1f}'} GiB, "
      f"vae_decode {r['vae_decode']}, encoded_first {r['encoded_first']}; phases "
      + ", ".join(f"{k} {v:.2f} s" for k, v in r["phases_s"].items()))
PY
done
