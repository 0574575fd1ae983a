"""The options of a job (`generate`'s and, with its own beside them, `serve`'s), and their defaults."""
from __future__ import annotations

import argparse

import torch

from ..core.config import METHODS
from ..core.transports import TRANSPORTS, transport_names
from ..diffusers.stack.spec import QUANTIZE
from ..models import MODELS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_PROMPT = "a photo of a red cat on a quiet street at sunset"
WEIGHTS_SEED = 0  # random weights' seed unless --weights-seed: apart from the generation's --seed, so every seed
# of `generate` and every request of `serve` run on the same model
SPAWN_SHAPE = (2, 2)  # machines x processes per machine of a CPU job not under torchrun


def native_steps(text: str) -> tuple[int, int]:
    """--attention-native-steps FIRST,LAST."""
    try:
        first, last = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give FIRST,LAST, two step counts, e.g. 1,1") from None
    if first < 0 or last < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: step counts are at least 0")
    return first, last


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny-flux",
                        help="tiny-* build small random models for the CPU; the others are real size (random "
                             "weights unless --weights)")
    parser.add_argument("--weights", default=None,
                        help="hub id or local folder of a diffusers pipeline (default: random weights)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--image", action="append", default=None, metavar="PATH",
                        help="an input image: the image an edit model (qwen-image-edit, flux-kontext) edits, a "
                             "Flux.2 reference (repeat for several), Wan 2.2 TI2V's first frame")
    parser.add_argument("--height", type=int, default=None, help="pixels (default: the model's)")
    parser.add_argument("--width", type=int, default=None, help="pixels (default: the model's)")
    parser.add_argument("--frames", type=int, default=None,
                        help="video frames, video models only (default: the model's)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    parser.add_argument("--guidance-scale", type=float, default=None,
                        help="CogVideoX, Wan: CFG (two branches when > 1); Flux.1, Flux.2: distilled guidance "
                             "(default: the model's; Qwen-Image has none)")
    parser.add_argument("--max-sequence-length", type=int, default=None, help="text tokens (default: the model's)")
    parser.add_argument("--seed", type=int, default=0, help="the generation's noise (default 0)")
    parser.add_argument("--weights-seed", type=int, default=WEIGHTS_SEED,
                        help=f"the seed random weights are built from (default {WEIGHTS_SEED}); without --weights "
                             f"only")
    parser.add_argument("--deterministic", action="store_true",
                        help="pin every kernel and backend choice instead of timing them in each process (the "
                             "attention kernel, the SDPA backend; cuDNN and torch's deterministic algorithms), so "
                             "two runs of the same job on the same GPUs give the same pixels; may run slower")
    parser.add_argument("--method", choices=METHODS + ("auto",), default="auto",
                        help="default auto: the layout of the recipe entry for this shape and cluster (see --recipe), "
                             "else the cost model's fastest; chosen at the first attention call and logged")
    parser.add_argument("--ulysses", type=int, default=None, help="Ulysses degree U (default: from the heads)")
    parser.add_argument("--ring", type=int, default=None, help="Ring degree R (default: P / U)")
    parser.add_argument("--torus", type=int, default=None, help="Torus degree T (torus method only)")
    parser.add_argument("--machines", type=int, default=None,
                        help=f"machines N (default: 1 on GPUs, {SPAWN_SHAPE[0]} on the CPU, the node count under "
                             f"torchrun)")
    parser.add_argument("--gpus-per-machine", type=int, default=None,
                        help=f"processes per machine M (default: every visible GPU, {SPAWN_SHAPE[1]} on the CPU, "
                             f"LOCAL_WORLD_SIZE under torchrun)")
    parser.add_argument("--backend", choices=transport_names(), default=None,
                        help="transport: " + "; ".join(f"{s.name} ({s.summary})" for s in TRANSPORTS.values())
                             + "; one that cannot run falls back to torch with one warning; default torch")
    parser.add_argument("--emulate-link", default=None, metavar="LINK",
                        help="make every transfer between machines as slow as LINK: a preset (dgx, p4de, p5) or "
                             "GBPS:LATENCY_US (e.g. 25:10), so that one host's processes stand in for --machines "
                             "machines; run.json's (and a served answer's) crossed counts what rank 0 sent and "
                             "received across them")
    parser.add_argument("--recipe", default=None,
                        help="where --method auto looks: a packaged recipe (flux-dev), a YAML path or a folder of "
                             "them (streamfusion tune --out); default: the packaged recipes")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default float32 on the CPU, bfloat16 on GPUs")
    parser.add_argument("--output", default="streamfusion-output", help="folder for the image/video and run.json")
    parser.add_argument("--cpu", action="store_true",
                        help="gloo processes on the CPU even where GPUs are visible (default: one NCCL process per GPU)")
    parser.add_argument("--cfg-parallel", nargs="?", const="2", choices=("1", "2", "auto"), default="1",
                        help="compute the two classifier-free-guidance branches at once, each on half of the ranks "
                             "(one branch per half of the machines when the machine count is even); "
                             "'auto': when guidance is on")
    parser.add_argument("--true-cfg-scale", type=float, default=None,
                        help="Flux.1, Qwen-Image: true classifier-free guidance with an empty negative prompt "
                             "when > 1")
    parser.add_argument("--comm-dtype", choices=("int8", "fp8"), default=None,
                        help="send every attention chunk that crosses machines (Torus Pull Q, Pull KV, Push O; ring "
                             "passes) as 1-byte values with per-token-and-head scales: int8 (about 0.65 %% rms per "
                             "value) or fp8 (float8_e4m3fn, about 2.6 %%); intra-machine traffic is untouched")
    parser.add_argument("--attention", choices=("native", "int8", "fp8"), default="native",
                        help="native (default): attention in the inputs' precision; int8: Q K^T on int8 tensor "
                             "cores, P V in half precision (GPUs of compute capability 8.0+); fp8: P V on float8 "
                             "ones too, SageAttention 2's recipe (8.9+, the less accurate); per-row scales, keys "
                             "smoothed, log-sum-exp kept for ring and Torus merges; triton; except the "
                             "--attention-native-steps")
    parser.add_argument("--attention-native-steps", type=native_steps, default=(1, 1), metavar="FIRST,LAST",
                        help="with --attention int8|fp8: the first and last steps that still attend natively, where "
                             "quantization errors cost the most (default 1,1; 0,0: every step quantized)")
    parser.add_argument("--vae-split", action=argparse.BooleanOptionalAction, default=True,
                        help="split the VAE decode over the ranks (default): one band of latent rows per rank, "
                             "exact (the VAEs of Flux.1, Flux.2, CogVideoX, Wan 2.x, Qwen-Image), else diffusers' "
                             "tiles shared out, else rank 0 decodes for all (run.json's vae_decode says which); "
                             "--no-vae-split decodes untiled on rank 0 only")
    parser.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                        help="replay the transformer forward from a CUDA graph, captured once per shape (default on "
                             "GPUs, where it is exact, sharded weights' in-place gathers included: not with --cache, "
                             "which then runs eager and says why; --no-cuda-graph runs every step eager)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile the transformer's repeated blocks (fullgraph, diffusers' "
                             "compile_repeated_blocks), replayed from the CUDA graph where graphs are on (default "
                             "on GPUs: where a measured compiled step pays for the compile over generate's steps; "
                             "serve compiles only when asked; run.json says why; --no-compile never)")
    parser.add_argument("--compile-cache", default=None, metavar="DIR",
                        help="with --compile: the folder inductor keeps its compiled graphs and kernels in, so that a "
                             "restart on it compiles from them (default: ~/.cache/streamfusion/inductor, under "
                             "$XDG_CACHE_HOME where set; run.json and serve's /health say which)")
    parser.add_argument("--shard-weights", action="store_true",
                        help="every rank holds 1/P of as many of the transformer's blocks (and text encoders) as "
                             "--max-memory needs, each gathered in place just before it runs, the others gathered "
                             "once: the same output in less memory per GPU, with --compile, --quantize and, asked for, "
                             "--cuda-graph (`streamfusion plan --memory` shows the split)")
    parser.add_argument("--max-memory", type=float, default=None, metavar="GIB",
                        help="--shard-weights: GiB per GPU the run may take (default on GPUs: the free memory; the "
                             "activations and a margin are kept out of it); on the CPU, without it every block is "
                             "sharded")
    parser.add_argument("--streamed-blocks", choices=("gather", "tensor", "auto"), default=None,
                        help="--shard-weights: how a block that streams runs: gather (its weights gathered just "
                             "before it runs), tensor (Flux.1, Flux.2, Qwen-Image: it keeps 1/P of its projections "
                             "and runs tensor-parallel, its tokens moved instead: fewer bytes at image sizes; where "
                             "it cannot, one line says why and it gathers), or auto, the default (the one that moves "
                             "fewer bytes a step at this size, as plan --memory counts them)")
    parser.add_argument("--cache", default=None, metavar="NAME[:VALUE]",
                        help="one of diffusers' caches, its skip decisions agreed over the ranks: first-block[:T] "
                             "(skip the other blocks while the first block's residual changes by less than T, "
                             "default 0.05), taylorseer[:N] (a full step every N, default 5), magcache[:T] (Flux.1, "
                             "default 0.06), pab[:N] (self-attention every N-th step in timesteps 100..800, default 2)")
    parser.add_argument("--lora", action="append", default=None, metavar="[NAME=]PATH[:SCALE]",
                        help="a local LoRA (.safetensors file, or the folder save_lora_weights wrote) fused into the "
                             "weights with SCALE (default 1); repeat for several (extra lora). NAME=PATH keeps it "
                             "unfused as adapter NAME: serve runs it for the requests whose lora field names it "
                             "(SCALE: their default weight), generate runs it at SCALE")
    parser.add_argument("--quantize", choices=QUANTIZE, default=None,
                        help="torchao quantization of the transformer's Linear layers: int8 or fp8 weight-only "
                             "(less memory), or fp8-dynamic (float8 weights and per-row activations: float8 "
                             "matmuls, faster); fp8 needs a GPU of compute capability 8.9+ (extra quantize)")


__all__ = ["DEFAULT_PROMPT", "DTYPES", "SPAWN_SHAPE", "WEIGHTS_SEED", "add_arguments", "native_steps"]
