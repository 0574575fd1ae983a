"""What a LoRA per request costs `streamfusion serve` on one GPU: two random LoRAs of the model's attention
projections are written (rank RANK, the model's real layer names, found on the meta device), then one server
with `--lora a=... --lora b=...` answers

1. each choice (none, a, b) once, the first request of a choice (with CUDA graphs: its graphs captured);
2. REPEATS requests of one choice after another ("same": a, a, a, ...) and REPEATS alternating ("switch": a, b,
   none, a, ...), all at the same seed, size and steps;

and the record says, per request, what turning the adapters on cost (`lora.switch_s`, host seconds of
`set_adapters` / `disable_lora` on rank 0). Prints one line and writes OUT/lora_switch.json: the medians of the
client's seconds for "same" and "switch" (their difference: what a switch costs a request end to end), of
switch_s, and the first requests' seconds.

    python benchmarks/lora_switch.py --out OUT [--model flux-dev] [--steps 8] [--repeats 9] [--rank 16] [--cpu]
"""
from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PROMPT = "a photo of a red cat on a quiet street at sunset"
TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # the attention projections, as LoRAs for these models train them


def write_lora(model: str, rank: int, seed: int, path: Path) -> Path:
    """A random LoRA (peft's keys, as save_lora_weights writes them) on every attention projection of the
    model's transformer, whose layer names and sizes are read from the pipeline built on the meta device."""
    import torch
    from safetensors.torch import save_file

    from streamfusion_diffusers.models.build import build_pipeline
    from streamfusion_diffusers.models.full import build_full_pipeline

    build = build_pipeline if model.startswith("tiny-") else build_full_pipeline
    transformer = build(model, dtype=torch.bfloat16, device="meta").transformer
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(TARGETS):
            a = torch.randn(rank, module.in_features, generator=generator) / module.in_features ** 0.5
            b = torch.randn(module.out_features, rank, generator=generator) / rank ** 0.5 * 0.1
            tensors[f"transformer.{name}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
            tensors[f"transformer.{name}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
    assert tensors, f"{model}: no {TARGETS} layers"
    save_file(tensors, str(path))
    return path


def post(http: httpx.Client, lora: str | None, steps: int) -> dict:
    started = time.monotonic()
    body = {"prompt": PROMPT, "seed": 0, "num_inference_steps": steps, **({"lora": lora} if lora else {})}
    answer = http.post("/v1/images/generations", json=body, timeout=600)
    seconds = time.monotonic() - started
    if answer.status_code != 200:
        raise RuntimeError(f"lora {lora}: {answer.status_code} {answer.text[:500]}")
    run = answer.json()["streamfusion"]["runs"][0]
    return {"lora": lora, "seconds": seconds, "switch_s": run["lora"]["switch_s"],
            "generate_s": run["generate_s"], "cuda_graph": run["cuda_graph"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="flux-dev")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--cpu", action="store_true", help="tiny model on 4 gloo ranks: the script's own check")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    loras = {name: write_lora(args.model, args.rank, seed, args.out / f"lora-{name}.safetensors")
             for name, seed in (("a", 1), ("b", 2))}
    command = [sys.executable, "-m", "streamfusion_diffusers", "serve", "--model", args.model, "--port", "0",
               "--max-batch", "1", *(x for n, p in loras.items() for x in ("--lora", f"{n}={p}")),
               *(["--cpu"] if args.cpu else [])]
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    url = next((line.split(" on ")[1].split()[0] for line in proc.stdout if line.startswith("serving ")), None)
    if url is None:
        raise RuntimeError("serve ended before it was ready:\n" + "".join(err)[-3000:])
    ready_s = time.monotonic() - started
    try:
        with httpx.Client(base_url=url) as http:
            first = [post(http, lora, args.steps) for lora in (None, "a", "b")]
            same = [post(http, "a", args.steps) for _ in range(args.repeats)]
            cycle = ("b", None, "a")
            switch = [post(http, cycle[i % 3], args.steps) for i in range(args.repeats)]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    median = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
    result = {"model": args.model, "steps": args.steps, "rank": args.rank, "ready_s": ready_s,
              "first_s": {str(r["lora"]): r["seconds"] for r in first},
              "same_s": median(same, "seconds"), "switch_s": median(switch, "seconds"),
              "switch_cost_s": median(switch, "seconds") - median(same, "seconds"),
              "set_adapters_s": median(switch, "switch_s"), "runs": first + same + switch}
    (args.out / "lora_switch.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.model} {args.steps} steps, rank {args.rank}: same adapter {result['same_s']:.3f} s/request, "
          f"switching {result['switch_s']:.3f} s/request ({result['switch_cost_s'] * 1e3:+.1f} ms), set_adapters "
          f"{result['set_adapters_s'] * 1e3:.2f} ms; first request per choice "
          + ", ".join(f"{k} {v:.2f} s" for k, v in result["first_s"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
