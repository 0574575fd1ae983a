#!/usr/bin/env bash
# The next session's first call on any GPU machine (one GPU is enough; about 6 minutes). First the GPU test of
# compiled blocks captured in our CUDA graph (tiny Flux, Qwen-Image, Wan); then, now that the capture runs on the
# warm-up's stream (graphs.capture), do the real-size Qwen-Image's and Wan 2.2's compiled blocks capture? Each
# model runs with default flags, then with --compile, logging dynamo's recompile reasons. The summary lines are
# the records choice/recipes/compiled.json takes: copy the log under benchmarks/results/ and add a record per
# pair. Run from the project root after the device preamble; logs under $OUT.
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
timeout 300 python -m pytest -m gpu -x -v tests/test_compiled.py -k captured 2>&1 | tail -15 > "$OUT/compiled_tests.log"
cat "$OUT/compiled_tests.log"
timeout 90 python -m pytest -m gpu -x -q tests/test_graphs.py 2>&1 | tail -3  # graphs bit-identical to eager
GEN_PS=1 OUT=$OUT timeout 120 bash benchmarks/default_path_gpu.sh > /dev/null 2>&1  # the default path after the change
grep -E "ms/step" "$OUT/default_path.log"
for spec in "qwen-image --height 1328 --width 1328 --steps 6" \
            "wan2.2-ti2v-5b --height 704 --width 1280 --frames 121 --steps 4"; do
  for flags in "" "--compile"; do
    echo "=== generate --model $spec $flags" >> "$OUT/compiled.log"
    CUDA_VISIBLE_DEVICES=0 TORCH_LOGS=recompiles timeout 200 python -m streamfusion_diffusers generate --model $spec \
      $flags --output /tmp/next 2>&1 | tr '\r' '\n' | grep -v -E "(it/s|s/it)\]" >> "$OUT/compiled.log"
  done
done
grep -E "^===|ms/step|failed|Recompiling|guard" "$OUT/compiled.log" | cut -c1-400
