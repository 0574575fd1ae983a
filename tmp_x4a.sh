#!/usr/bin/env bash
# session 36, x4 call 4: generate's split with the lean teardown; serve's start-up by stage; the MLP overlap eager
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
git log --oneline -1 > $OUT/commit.txt 2>/dev/null || true
timeout 100 python -m streamfusion_diffusers generate --model flux-dev --height 1024 --width 1024 --steps 8 --output /tmp/g4 2>&1 | grep -E "^streamfusion generate: flux|^phases" | tee $OUT/generate.log
cp /tmp/g4/run.json $OUT/generate_run.json
timeout 200 python benchmarks/serve_load.py --out /tmp/serve --models flux-dev --steps 28 --requests 4 2>&1 | tail -2 | tee $OUT/serve.log
cp /tmp/serve/serve_gpu.json $OUT/ 2>/dev/null
timeout 110 torchrun --nproc-per-node 4 benchmarks/overlap_bench.py --workloads flux-dev:1024 --variants stock,mlp \
  --graph eager --repeats 6 --out $OUT/overlap_mlp_eager.json 2>&1 | grep "^{" | tee $OUT/overlap_mlp_eager.log
