#!/usr/bin/env bash
# session 41 call 5: the one-pass RoPE on GPU (bits), then generate P = 4 before (HEAD~1's package) and after, one machine
set -u
export PYTHONUNBUFFERED=1
L=$OUT/call5.log
date -u > $L; nvidia-smi --query-gpu=name --format=csv,noheader | head -1 >> $L
timeout 70 python -m pytest -x -q tests/test_kernels_gpu.py -k rotary > $OUT/rope_tests.log 2>&1; tail -2 $OUT/rope_tests.log >> $L
for v in after before after2; do
  echo "== $v" >> $L
  if [ $v = before ]; then (cd .dev/main && PYTHONPATH=/tmp/site:$PWD timeout 50 python -m streamfusion_diffusers generate --model flux-dev --height 1024 --width 1024 --steps 8 --output /tmp/g-$v > $OUT/gen_$v.log 2>&1)
  else timeout 50 python -m streamfusion_diffusers generate --model flux-dev --height 1024 --width 1024 --steps 8 --output /tmp/g-$v > $OUT/gen_$v.log 2>&1; fi
  grep -E "^streamfusion generate: flux|^phases|Error" $OUT/gen_$v.log | cut -c1-400 >> $L
done
python - >> $L 2>&1 <<'PY'
import numpy as np
from PIL import Image
a, b = (np.asarray(Image.open(f"/tmp/g-{v}/image.png")).astype(int) for v in ("after", "before"))
print("pixels differing after/before:", float((a != b).any(-1).mean()), "max", int(abs(a - b).max()))
PY
date -u >> $L
