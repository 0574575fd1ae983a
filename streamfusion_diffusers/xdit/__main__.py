"""Run an xfuser script with our attention: `python -m streamfusion_diffusers.xdit SCRIPT [--sf-*] XFUSER_ARGS`.

    torchrun --nproc-per-node 8 -m streamfusion_diffusers.xdit examples/cogvideox_example.py \\
        --sf-method torus --sf-machines 1 --model THUDM/CogVideoX-5b --ulysses_degree 4 --ring_degree 2 ...

The script runs as `python SCRIPT XFUSER_ARGS` would; every xfuser pipeline it builds is passed to
`enable(...)` as its constructor returns. xfuser's pipeline constructor (xFuserPipelineBaseWrapper.__init__) is
the one place every pipeline goes through, from_pretrained or not, after xfuser made its process groups and
wrapped the transformer; it is patched for the length of the script and restored after.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import runpy
import sys
from collections.abc import Sequence
from typing import Any

from ..core.config import KERNELS, METHODS
from ..core.transports import transport_names
from ..core.extras import missing


def parse(argv: Sequence[str]) -> tuple[str, dict[str, Any], list[str]]:
    """(script, enable() keywords, the script's own arguments) from our command line."""
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python -m streamfusion_diffusers.xdit SCRIPT [--sf-method M] [--sf-machines N] "
                         "[--sf-backend B] [--sf-ulysses U] [--sf-ring R] [--sf-torus T] [--sf-kernel K] "
                         "[--sf-emulate-link LINK] SCRIPT_ARGS...")
    parser = argparse.ArgumentParser(prog="python -m streamfusion_diffusers.xdit", allow_abbrev=False)
    parser.add_argument("--sf-method", dest="method", choices=(*METHODS, "auto"), default="auto")
    parser.add_argument("--sf-machines", dest="machines", type=int, default=None,
                        help="machines the job runs on (default: WORLD_SIZE / LOCAL_WORLD_SIZE)")
    parser.add_argument("--sf-backend", dest="backend", choices=transport_names(aliases=True), default="torch")
    parser.add_argument("--sf-ulysses", dest="ulysses", type=int, help="default: xfuser's --ulysses_degree")
    parser.add_argument("--sf-ring", dest="ring", type=int, help="default: xfuser's --ring_degree")
    parser.add_argument("--sf-torus", dest="torus", type=int)
    parser.add_argument("--sf-kernel", dest="kernel", choices=KERNELS)
    parser.add_argument("--sf-emulate-link", dest="emulate_link")
    ours, rest = parser.parse_known_args(argv[1:])
    options = {k: v for k, v in vars(ours).items() if v is not None or k == "machines"}
    return argv[0], options, rest


def run(script: str, options: dict[str, Any], args: Sequence[str]) -> None:
    """Run `script` with `args`, enabling our attention on every xfuser pipeline it constructs."""
    from xfuser.model_executor.pipelines import xFuserPipelineBaseWrapper

    from . import enable

    original = xFuserPipelineBaseWrapper.__init__

    @functools.wraps(original)
    def init_then_enable(self: Any, *a: Any, **kw: Any) -> None:
        original(self, *a, **kw)
        enable(self, **options)

    xFuserPipelineBaseWrapper.__init__ = init_then_enable
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        xFuserPipelineBaseWrapper.__init__ = original


def main(argv: Sequence[str] | None = None) -> None:
    script, options, args = parse(sys.argv[1:] if argv is None else argv)
    if importlib.util.find_spec("xfuser") is None:
        raise SystemExit(f"python -m streamfusion_diffusers.xdit: error: {missing('xfuser')}")
    run(script, options, args)


if __name__ == "__main__":
    main()
