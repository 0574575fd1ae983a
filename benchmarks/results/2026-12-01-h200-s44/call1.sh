#!/usr/bin/env bash
# Session 44's first call on one H200 (the only kind lent): where the ranks' imports go (cold, then warm bytecode),
# the one-GPU GPU tests, the default path at P = 1 (graphs, --no-cuda-graph). Logs under $OUT.
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/call1.log"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/call1.log"
imports="import torch, diffusers.pipelines.flux, transformers, streamfusion_diffusers.runtime"
for pass in cold warm; do
  s=$(date +%s.%N); python -X importtime -c "$imports" 2> "$OUT/importtime_$pass.log"; e=$(date +%s.%N)
  echo "imports $pass: $(python -c "print(round($e - $s, 2))") s" | tee -a "$OUT/call1.log"
done
sort -t'|' -k2 -n -r "$OUT/importtime_cold.log" | head -25 > "$OUT/importtime_top.log"
gzip -f "$OUT/importtime_cold.log" "$OUT/importtime_warm.log"
timeout 280 python -m pytest -m gpu -x -q -p no:cacheprovider 2>&1 | tail -40 > "$OUT/gpu_tests.log"
echo "gpu tests: exit ${PIPESTATUS[0]}" | tee -a "$OUT/call1.log"; tail -3 "$OUT/gpu_tests.log" | tee -a "$OUT/call1.log"
GEN_PS="1" OUT=$OUT timeout 250 bash benchmarks/default_path_gpu.sh > /dev/null 2>&1
grep -E "^===|median|wall" "$OUT/default_path.log" | tee -a "$OUT/call1.log"
python -c "
import json; r=json.load(open('$OUT/default_path.json'))
for k,v in r.items(): print(k, v['layout'], 'median', round(1e3*(v['median_after_first_s'] or 0),1), 'ms first', round(1e3*v['steps_s'][0],1), 'ms build', round(v['build_s'],1), 's one-time', v.get('one_time_s'), 'graphs', v['cuda_graph'])
" | tee -a "$OUT/call1.log"
