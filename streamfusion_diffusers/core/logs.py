"""Messages said once per job: fallbacks and choices go to the log on global rank 0 only, each distinct message
once, instead of once per rank (and per context, layer or call) as every rank reaches the same code; what other
libraries say is silenced unless asked for (`-v`)."""
from __future__ import annotations

import logging
import os
import sys
import warnings

# What was said in this job: module-level as the logging module's own registry is (say_once is called where no
# context is at hand), and emptied by shutdown(), which ends the job.
_said: set[tuple[str, int, str]] = set()


def is_rank0() -> bool:
    """This process is the job's global rank 0 (or runs alone). torch.distributed is not imported here: a process
    that never imported it has no process group (and the package's import stays light: fork_server.py)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def say_once(logger: logging.Logger, level: int, msg: str, *args: object) -> None:
    """logger.log(level, msg, *args) on global rank 0, the first time this text is said in this process."""
    key = (logger.name, level, msg % args if args else msg)
    if key in _said or not is_rank0():
        return
    _said.add(key)
    logger.log(level, msg, *args)


def forget_said() -> None:
    """The job ended (shutdown()): the next one says its messages again."""
    _said.clear()


# Loggers of other libraries whose notices every process of a job prints alike: transformers' optional backends
# it falls back from ("`CLIPImageProcessor` requires torchvision (not installed)", at diffusers' import).
PER_PROCESS_NOTICES = ("transformers.utils.import_utils",)


def quiet_other_ranks() -> None:
    """On every rank but the job's rank 0, drop PER_PROCESS_NOTICES below ERROR: a job of 8 ranks says each one
    once, not 8 times. Called at this package's import (the launcher's RANK) and by init_parallel (the group's
    rank); the level is set on loggers by name, so it holds whether transformers is imported yet or not."""
    if not is_rank0():
        for name in PER_PROCESS_NOTICES:
            logging.getLogger(name).setLevel(logging.ERROR)


def quiet_third_party(verbose: bool) -> None:
    """Silence other libraries' Python warnings and their logs below ERROR (transformers' and diffusers': optional
    backends they fall back from, tokenizer truncation), unless `verbose`. Set in the environment too, so that
    the ranks a command spawns inherit it."""
    if verbose:
        return
    os.environ["STREAMFUSION_QUIET"] = "1"  # the ranks a command spawns read it (quiet_noisy_loggers)
    quiet_noisy_loggers()
    warnings.filterwarnings("ignore", module=r"(?!streamfusion_diffusers)")
    for library in ("transformers", "diffusers"):
        os.environ.setdefault(f"{library.upper()}_VERBOSITY", "error")
        if library in sys.modules:  # imported already: its logging read the environment then
            sys.modules[library].utils.logging.set_verbosity_error()


# Loggers that print at import, in every process, what no user acts on: torchao's optional CUDA extensions it
# could not load on this machine, and torch's notice on the Enum types torchao registers with pytree.
NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_noisy_loggers() -> None:
    """NOISY_LOGGERS below ERROR: by a command unless `-v`, and in the ranks it spawns (STREAMFUSION_QUIET)."""
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)

