#!/usr/bin/env bash
# Session 44's third call on one H200: compiled-in-the-graph against the graphed eager kernels at P = 1 per model
# (`generate` default flags, then --compile): what a compile costs and saves per step, for the compile choice; serve
# with default flags (it compiles by that choice). Logs under $OUT.
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
work=$(mktemp -d)
run() {  # name, timeout, generate args...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" python -m streamfusion_diffusers generate --output "$work/$name" "$@" > "$work/$name.log" 2>&1
  echo "=== $name: exit $? wall $((SECONDS - start)) s: $*" | tee -a "$OUT/call3.log" >> "$OUT/generate.log"
  tr "\r" "\n" < "$work/$name.log" | grep -v -E "(it/s|s/it)\]" >> "$OUT/generate.log"
  python - "$work/$name/run.json" <<'PY' | tee -a "$OUT/call3.log"
import json, statistics, sys
try:
    r = json.load(open(sys.argv[1]))
except OSError:
    sys.exit(0)
s = r["step_latency_s"]
print(f"  {r['layout']}  median step after the first {1e3 * statistics.median(s[1:]):.1f} ms (min {1e3 * min(s[1:]):.1f}, "
      f"max {1e3 * max(s[1:]):.1f})  first {1e3 * s[0]:.0f} ms  startup {r.get('startup_s')}  graphs {r['cuda_graph']}  "
      f"phases {r['phases_s']}  peak {r.get('peak_memory_gib')}")
PY
}
run flux-graph 120 --model flux-dev --height 1024 --width 1024 --steps 8
run flux-compile 150 --model flux-dev --height 1024 --width 1024 --steps 8 --compile
run qwen-graph 120 --model qwen-image --height 1328 --width 1328 --steps 6
run qwen-compile 160 --model qwen-image --height 1328 --width 1328 --steps 6 --compile
# serve with default flags (the compile choice: a server compiles where a record measured a saving); the inductor
# cache is warm from flux-compile above
timeout 200 python benchmarks/serve_load.py --out /tmp/serve --models flux-dev --steps 28 --requests 4 > "$OUT/serve.log" 2>&1
echo "=== serve_load: exit $?" | tee -a "$OUT/call3.log"; tail -3 "$OUT/serve.log" | tee -a "$OUT/call3.log"
cp /tmp/serve/serve_gpu.json "$OUT/serve_gpu.json" 2>/dev/null
run wan-graph 120 --model wan2.2-ti2v-5b --height 704 --width 1280 --frames 121 --steps 4
run wan-compile 160 --model wan2.2-ti2v-5b --height 704 --width 1280 --frames 121 --steps 4 --compile
