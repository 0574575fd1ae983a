"""`streamfusion bench` (layer, block, step and e2e timing against the baselines) and `streamfusion tune` (the
fastest layout per workload, measured into recipes): above the commands whose jobs they time, below the
dispatcher (streamfusion_diffusers/cli.py)."""
