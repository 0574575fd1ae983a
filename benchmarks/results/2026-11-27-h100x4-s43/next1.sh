#!/usr/bin/env bash
# The next session's first call on 4 x H100 (about 6 minutes): the emulated link's copy-engine bookings on GPUs
# (their tests, then the 4 x 1 USP step that stopped in call 3), the all-to-all of SM peer loads against NCCL's,
# and where the imports' time goes. Run from the project root after the device preamble; logs under $OUT.
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
timeout 120 python -m pytest -x -v tests/test_emulated_gpu.py > "$OUT/emu_tests.log" 2>&1
echo "emulated tests: exit $?" | tee "$OUT/next1.log"
grep -E "PASSED|FAILED|^E " "$OUT/emu_tests.log" | head -20 >> "$OUT/next1.log"
timeout 120 torchrun --nproc-per-node 4 benchmarks/sm_a2a_probe.py > "$OUT/sm_probe.log" 2>&1
echo "probe: exit $?" >> "$OUT/next1.log"
grep -E "_(us|exact|error): " "$OUT/sm_probe.log" >> "$OUT/next1.log"
python -X importtime -c "import torch, diffusers.pipelines.flux, transformers, streamfusion_diffusers.runtime" \
  2> "$OUT/importtime.log"
gzip -f "$OUT/importtime.log"
MACHINES=4 CASES="usp:U4R1" OUT=$OUT timeout 230 bash benchmarks/emulated_steps_gpu.sh
cat "$OUT/emulated_steps.log" >> "$OUT/next1.log"
cat "$OUT/next1.log"
