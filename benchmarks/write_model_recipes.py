"""Write the packaged recipes until `streamfusion tune` measures them.

One machine: Ulysses over all GPUs (USP with U = gcd(P, heads) when the heads do not split), what the paper's
Section 5.1 and our 8 x H200 measurements of xDiT (../shared/device/FACTS.md: U8R1 best for every workload)
both say. Several machines: the cost model's best layout on the DGX link preset. Each entry says its source.
Run from the repository root: python benchmarks/write_model_recipes.py
"""
from __future__ import annotations

import math

import yaml

from streamfusion_diffusers.bench.costmodel import candidate_layouts, predict
from streamfusion_diffusers.links import PRESETS
from streamfusion_diffusers.bench.workloads import cogvideox, flux
from streamfusion_diffusers.config import METHODS

SHAPES = [(1, 2), (1, 4), (1, 8), (2, 8), (4, 8)]
MODELS = [("flux-dev", [1024, 2048, 3072, 4096], "resolution", flux),
          ("cogvideox-5b", [49, 161, 321], "frames", cogvideox)]


def entry(n: int, m: int, key: str, size: int, make) -> dict:
    w = make(size)
    base = {"machines": n, "gpus_per_machine": m, key: size}
    if n == 1:
        u = math.gcd(m, w.heads)
        method = "ulysses" if u == m else "usp"
        return {**base, "method": method, "ulysses": u, "ring": m // u,
                "source": "one machine: Ulysses (paper 5.1; xDiT U8R1 measured best on 8 x H200)"}
    preds = [predict(lay, w, PRESETS["dgx"]) for meth in METHODS for lay in candidate_layouts(meth, n, m, w.heads)]
    best = min(preds, key=lambda p: p.step_ms)
    lay = best.layout
    out = {**base, "method": lay.method, "ulysses": lay.ulysses, "ring": lay.ring}
    if lay.method == "torus":
        out["torus"] = lay.torus
    return {**out, "source": f"cost model, dgx link, predicted {best.step_ms:.0f} ms per step"}


for model, sizes, key, make in MODELS:
    doc = {"model": model, "entries": [entry(n, m, key, s, make) for n, m in SHAPES for s in sizes]}
    with open(f"streamfusion_diffusers/recipes/{model}.yaml", "w") as f:
        f.write(f"# {model}: the layout per cluster shape and size. Written by benchmarks/write_model_recipes.py\n"
                "# (2026-11-22) until measured; each entry's source says where its choice came from.\n")
        yaml.safe_dump(doc, f, sort_keys=False, default_flow_style=None, width=140)
