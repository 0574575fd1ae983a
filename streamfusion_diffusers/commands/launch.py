"""`streamfusion launch`: torchrun with the NVSHMEM environment sized for the model, on one machine or many.

    streamfusion launch [--nnodes N --nproc-per-node M --node-rank i --master-addr host --master-port p]
                        [--model flux-dev --resolution 2048 | --model cogvideox-5b --frames 49]
                        script.py args...  |  -m module args...

Runs `python -m torch.distributed.run` (torchrun) with the same arguments, and sets NVSHMEM_SYMMETRIC_SIZE
(unless already set) to what the largest sp_attention layer of that --model and size needs on N x M GPUs, so
backend "nvshmem" never runs out of symmetric heap. Every other variable passes through untouched, among
them the ones that keep NVLink multicast off (NCCL_NVLS_ENABLE, NVSHMEM_DISABLE_NVLS,
TORCH_SYMM_MEM_DISABLE_MULTICAST). The script calls `init_parallel(...)`, which joins the process group the
launcher set up and starts NVSHMEM. With --print-env it prints the variables instead (for accelerate). This
process becomes torchrun (exec), so a signal sent to it (a pod stopped, a launcher killed) reaches torchrun.
On one machine (--nnodes 1) it starts every process of the job, so it makes the job's join secret (a served job's
join port: runtime/wire.py) unless $STREAMFUSION_JOIN_KEY is set: its processes, and nobody else, know it.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

from ..attention.volume import peer_bytes
from ..backends.nvshmem_pool import heap_bytes as mailbox_heap_bytes
from ..choice.workloads import MODELS as WORKLOADS
from ..core.config import METHODS, ParallelConfig, resolve_layout
from ..core.sequence import split_sizes
from ..models import MODELS
from ..runtime.wire import JOIN_KEY_ENV, new_secret


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nnodes", type=int, default=1, help="machines N (default 1)")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="processes (GPUs) per machine M (default: every visible GPU, else 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0 .. N-1")
    parser.add_argument("--master-addr", default="127.0.0.1", help="address of machine 0 (default 127.0.0.1)")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--model", choices=sorted(WORKLOADS), default=None,
                        help="the model the script runs: sizes the NVSHMEM symmetric heap for it")
    parser.add_argument("--resolution", type=int, default=None, help="image side in pixels (image models)")
    parser.add_argument("--height", type=int, default=None, help="frame height in pixels (default: the model's)")
    parser.add_argument("--width", type=int, default=None, help="frame width in pixels (default: the model's)")
    parser.add_argument("--frames", type=int, default=None, help="video frames (video models)")
    parser.add_argument("--print-env", action="store_true",
                        help="print the environment it would set (export lines) and exit; for accelerate launch")
    parser.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    parser.add_argument("-m", "--module", action="store_true",
                        help="run SCRIPT as a Python module, as python -m does (e.g. -m streamfusion_diffusers bench)")
    parser.add_argument("script", nargs="?", help="the inference script (or module, with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


def sequence_tokens(model: str, height: int | None = None, width: int | None = None,
                    frames: int | None = None) -> tuple[int, int, int, int]:
    """(image/video tokens, text tokens, heads, head dim) of one transformer call of a named model, at the
    size given or `streamfusion generate`'s default for it."""
    if model not in WORKLOADS:
        raise ValueError(f"no shape known for model {model!r}; known: {', '.join(sorted(WORKLOADS))}")
    spec = MODELS[model]
    height, width = height or spec.height, width or spec.width
    w = WORKLOADS[model](frames or spec.frames, height, width) if spec.video else WORKLOADS[model](width, height)
    return w.tokens, w.text_tokens, w.heads, w.head_dim


def heap_bytes(tokens: int, joint: int, heads: int, head_dim: int, machines: int, gpus_per_machine: int,
               itemsize: int = 2, batch: int = 1) -> int:
    """NVSHMEM symmetric heap that every method's layer needs on this cluster shape (the worst of them)."""
    world = machines * gpus_per_machine
    lens = split_sizes(tokens, world)
    worst = 0
    for method in METHODS:
        try:
            layout = resolve_layout(ParallelConfig(machines=machines, gpus_per_machine=gpus_per_machine,
                                                   method=method), world, heads)
        except ValueError:  # e.g. Ulysses over more ranks than heads: that method cannot run here anyway
            continue
        worst = max(worst, peer_bytes(layout, lens, batch, heads, head_dim, joint, itemsize))
    return mailbox_heap_bytes(world, worst)


def nvshmem_env(args: argparse.Namespace, nproc: int) -> dict[str, str]:
    """The NVSHMEM variables to set: the symmetric heap, from the model and size."""
    model = args.model
    if model is None or "NVSHMEM_SYMMETRIC_SIZE" in os.environ:
        return {}
    side = args.resolution
    tokens, joint, heads, head_dim = sequence_tokens(model, args.height or side, args.width or side, args.frames)
    return {"NVSHMEM_SYMMETRIC_SIZE": str(heap_bytes(tokens, joint, heads, head_dim, args.nnodes, nproc))}


def torchrun_command(args: argparse.Namespace, nproc: int) -> list[str]:
    """`python -m torch.distributed.run ...` for these arguments (static rendezvous at machine 0)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={args.nnodes}",
            f"--nproc-per-node={nproc}", f"--node-rank={args.node_rank}", f"--master-addr={args.master_addr}",
            f"--master-port={args.master_port}", *(["--module"] if args.module else []), args.script,
            *args.script_args]


def _default_nproc() -> int:
    import torch

    return max(1, torch.cuda.device_count())


def main(args: argparse.Namespace) -> int:
    nproc = args.nproc_per_node or _default_nproc()
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank {args.node_rank} is not in 0 .. {args.nnodes - 1}")
    env = nvshmem_env(args, nproc)
    if args.print_env:
        for key, value in env.items():
            print(f"export {key}={shlex.quote(value)}")
        return 0
    if args.script is None:
        raise ValueError("name the script to run: streamfusion launch [options] script.py [args...]")
    command = torchrun_command(args, nproc)
    if args.dry_run:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(command))
        return 0
    if args.nnodes == 1 and not os.environ.get(JOIN_KEY_ENV):  # every process of the job starts here
        env[JOIN_KEY_ENV] = new_secret()
    # become torchrun (no child): a signal to this process (a pod stopped, a launcher killed) reaches torchrun itself,
    # and a served job's launched processes see their launcher gone
    os.execve(command[0], command, {**os.environ, **env})
