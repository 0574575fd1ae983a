"""Make a small random LoRA for tiny-flux, to try `--lora` and a request's `lora` field without training one:

    python examples/make_tiny_lora.py tiny-lora          # writes tiny-lora/pytorch_lora_weights.safetensors
    streamfusion serve --model tiny-flux --lora style=tiny-lora &
    curl -s http://127.0.0.1:8000/v1/images/generations -H "Content-Type: application/json" \
         -d '{"prompt": "a red cat", "size": "64x64", "seed": 3, "lora": [{"name": "style", "scale": 1}]}'

peft's random LoRA weights move the tiny model's pixels by a few levels at scale 1; here the up-projections are
multiplied by GAIN, so that scale 1 moves them by tens of levels and a smaller scale visibly less. Needs peft
(the lora extra: pip install -e ".[diffusers,lora]").
"""
from __future__ import annotations

import argparse

import torch

from streamfusion_diffusers.models.build import build_pipeline

GAIN = 20.0  # the up-projections' factor over peft's random ones
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_mlp"]  # the tiny Flux transformer's projections it adapts


def make_tiny_lora(folder: str, seed: int = 0, rank: int = 4) -> None:
    """A random LoRA on tiny-flux's attention and MLP projections, saved as diffusers' save_lora_weights saves one
    (what --lora PATH and --lora NAME=PATH read)."""
    from diffusers import FluxPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    transformer = build_pipeline("tiny-flux").transformer
    torch.manual_seed(seed)
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False, target_modules=TARGETS))
    layers = get_peft_model_state_dict(transformer)
    for name, weight in layers.items():
        if "lora_B" in name:
            weight.mul_(GAIN)
    FluxPipeline.save_lora_weights(folder, transformer_lora_layers=layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="where to write pytorch_lora_weights.safetensors (made if missing)")
    parser.add_argument("--seed", type=int, default=0, help="the random weights' seed (default 0)")
    args = parser.parse_args()
    make_tiny_lora(args.folder, args.seed)
    print(f"wrote {args.folder}/pytorch_lora_weights.safetensors: streamfusion serve --model tiny-flux "
          f"--lora style={args.folder}, then ask with \"lora\": [{{\"name\": \"style\", \"scale\": 1}}]")


if __name__ == "__main__":
    main()
