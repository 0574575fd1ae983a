#!/usr/bin/env bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
cat > /tmp/imp.py <<'PY'
import time, sys
t0 = time.perf_counter()
import streamfusion_diffusers.runtime.worker
import torch
torch.zeros(1, device="cuda")
t1 = time.perf_counter()
from diffusers.utils import logging
from streamfusion_diffusers.models.build import build_pipeline, load_pipeline
from streamfusion_diffusers.models.full import build_full_pipeline, encode_first
from streamfusion_diffusers.diffusers.compiled import compile_transformers
from streamfusion_diffusers.diffusers.parallel_pipeline import parallelize
from streamfusion_diffusers.diffusers.stack.apply import apply_stack
t2 = time.perf_counter()
print(f"worker+cuda {t1-t0:.2f} s, diffusers imports {t2-t1:.2f} s", file=sys.stdout)
PY
python -c "import sys; print(sys.version)"; pip list 2>/dev/null | grep -i -E "xformers|flash|sage|triton|torchao|transformers|peft|accelerate|kernels|apex|deepspeed|bitsandbytes" | tee $OUT/pkgs.txt
echo "--- first (cold pyc)"; python -X importtime /tmp/imp.py 2> $OUT/imp_cold.txt
echo "--- 4 at once"; for i in 0 1 2 3; do python -X importtime /tmp/imp.py 2> $OUT/imp4_$i.txt & done; wait
echo "--- one, warm"; python -X importtime /tmp/imp.py 2> $OUT/imp_warm.txt
