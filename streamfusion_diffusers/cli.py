"""The `streamfusion` command: one subcommand per job."""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING, NoReturn

from . import __version__
from .runtime import fork_server

if TYPE_CHECKING:
    from .commands.options import Parser

# name -> (module, help); the modules (torch, and what each command needs) are imported when the parser is made,
# after the fork server has started
COMMANDS = {
    "generate": (".commands.generate", "run a pipeline sequence-parallel (--model {models}, or a tiny one of each); "
                                       "writes the output and run.json"),
    "verify": (".commands.verify", "check every method against single-process attention on this cluster, with "
                                   "timings"),
    "launch": (".commands.launch", "run a script on N x M GPUs through torchrun, with the NVSHMEM heap sized for "
                                   "the model"),
    "bench": (".bench.command", "time a layer, block or step for every method and layout, against xDiT and "
                                "diffusers"),
    "tune": (".bench.tune", "measure the fastest layout per workload on this cluster and write it into YAML recipes"),
    "serve": (".serve.command", "serve a pipeline over HTTP with an OpenAI-compatible API, built once and kept warm"),
    "plan": (".commands.plan", "predict each method and layout on a cluster shape from the cost model, and "
                               "recommend one"),
}


def _module(name: str) -> ModuleType:
    return importlib.import_module(COMMANDS[name][0], __package__)


def make_parser() -> Parser:
    """The command line's parser, every subcommand's options in it (the deploy files' commands are checked by it)."""
    from .commands.options import Parser
    from .models.configs import MODELS

    models = ", ".join(m for m in MODELS if not m.startswith("tiny-"))
    parser = Parser(prog="streamfusion", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_verbose(parser, default=False)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        module = _module(name)
        command = sub.add_parser(name, help=help_text.format(models=models), description=module.__doc__)
        _add_verbose(command, default=argparse.SUPPRESS)
        module.add_arguments(command)
    return parser


def _add_verbose(parser: argparse.ArgumentParser, default: object) -> None:
    """-v before or after the subcommand; a subcommand's default is SUPPRESS, so that its parser, which argparse
    runs after the top one, leaves a -v given before it standing."""
    parser.add_argument("-v", "--verbose", action="store_true", default=default,
                        help="log at INFO level, with third-party warnings and every rank's traceback on failure")


def main(argv: list[str] | None = None) -> int:
    fork_server.start_early(sys.argv[1:] if argv is None else argv)  # its imports beside ours
    from .commands.options import check
    from .core.extras import missing
    from .core.logs import quiet_third_party
    from .runtime.pool import RankFailure

    args = make_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    quiet_third_party(args.verbose)
    where = f"streamfusion {args.command}"
    try:
        check(args)
        return _module(args.command).main(args)
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
