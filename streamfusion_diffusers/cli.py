"""The `streamfusion` command: one subcommand per job."""
from __future__ import annotations

import argparse
import logging
import sys

from . import generate, launch, plan, tune, verify
from .bench import command as bench

COMMANDS = {
    "generate": (generate, "run a Flux or CogVideoX pipeline sequence-parallel; writes the output and run.json"),
    "verify": (verify, "check every method against single-process attention on this cluster, with timings"),
    "launch": (launch, "run a script on N x M GPUs through torchrun, with the NVSHMEM heap sized for the model"),
    "bench": (bench, "time a layer, block or step for every method and layout, against xDiT and diffusers"),
    "tune": (tune, "measure the fastest layout per workload on this cluster and write it into YAML recipes"),
    "plan": (plan, "predict each method and layout on a cluster shape from the cost model, and recommend one"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamfusion", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=help_text, description=module.__doc__))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command][0].main(args)
    except ValueError as err:  # configuration errors already say what to change
        parser.exit(2, f"streamfusion {args.command}: error: {err}\n")


if __name__ == "__main__":
    sys.exit(main())
