"""The `streamfusion` command: one subcommand per job."""
from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

from .bench import command as bench
from .bench import tune
from .commands import generate, launch, plan, verify
from .commands.options import Parser, check
from .runtime.pool import RankFailure
from .core.extras import missing
from .core.logs import quiet_third_party
from .models.configs import MODELS
from .serve import command as serve

COMMANDS = {
    "generate": (generate, f"run a pipeline sequence-parallel (--model "
                           f"{', '.join(m for m in MODELS if not m.startswith('tiny-'))}, or a tiny one of each); "
                           f"writes the output and run.json"),
    "verify": (verify, "check every method against single-process attention on this cluster, with timings"),
    "launch": (launch, "run a script on N x M GPUs through torchrun, with the NVSHMEM heap sized for the model"),
    "bench": (bench, "time a layer, block or step for every method and layout, against xDiT and diffusers"),
    "tune": (tune, "measure the fastest layout per workload on this cluster and write it into YAML recipes"),
    "serve": (serve, "serve a pipeline over HTTP with an OpenAI-compatible API, built once and kept warm"),
    "plan": (plan, "predict each method and layout on a cluster shape from the cost model, and recommend one"),
}


def make_parser() -> Parser:
    """The command line's parser, every subcommand's options in it (the deploy files' commands are checked by it)."""
    parser = Parser(prog="streamfusion", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log at INFO level, with third-party warnings and every rank's traceback on failure")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=help_text, description=module.__doc__))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    quiet_third_party(args.verbose)
    where = f"streamfusion {args.command}"
    try:
        check(args)
        return COMMANDS[args.command][0].main(args)
    except ValueError as err:  # configuration errors already say what to change
        _fail(f"{where}: error: {err}")
    except ModuleNotFoundError as err:
        if missing(err.name) is None:
            raise
        _fail(f"{where}: error: {missing(err.name)}")
    except RankFailure as err:
        _fail(f"{where}: {err}" if args.verbose else f"{where}: {err.summary} (-v: every rank's traceback)", 1)


def _fail(message: str, code: int = 2) -> NoReturn:
    """Exit with one message on stderr, said by the job's rank 0 only (every rank of a launched job checks the
    same); code 2 as argparse's usage errors."""
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr)
    raise SystemExit(code)


if __name__ == "__main__":
    sys.exit(main())
