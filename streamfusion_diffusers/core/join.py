"""Joining the job's process group: the one place a process group is created, with one default timeout.

Local jobs (spawn.py), launched jobs (torchrun, `streamfusion launch`, accelerate: init_parallel and the
commands) all come here, so every rank of every job waits on a lost peer for the same bounded time.
"""
from __future__ import annotations

import atexit
import datetime
import os

import torch
import torch.distributed as dist

from .config import DEFAULT_TIMEOUT_S


def launched() -> bool:
    """True when this process is one rank of a job a launcher started (torchrun sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def join_job(gpu: bool | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Create the default process group from what the launcher set (RANK, WORLD_SIZE, MASTER_ADDR/PORT,
    LOCAL_RANK): NCCL with one GPU per process (gpu None: where CUDA is available), else gloo. Every
    collective on it fails after `timeout_s` instead of hanging. Returns whether it created the group
    (False: one exists already, and its creator tears it down)."""
    if dist.is_initialized():
        return False
    if not launched():
        raise RuntimeError("torch.distributed is not initialized: call dist.init_process_group (or launch with "
                           "torchrun / `streamfusion launch`) before init_parallel")
    gpu = torch.cuda.is_available() if gpu is None else gpu
    dist.init_process_group("nccl" if gpu else "gloo", timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=_own_gpu() if gpu else None)
    return True


def _own_gpu() -> torch.device:
    """This process's GPU (LOCAL_RANK's), made current. Given to init_process_group as `device_id`, it binds
    the group to it: NCCL's communicator is made at the join (start-up) rather than inside the first step,
    and the layout's groups are split from it (ncclCommSplit) instead of being made anew."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    try:
        torch.cuda.set_device(device)
    except RuntimeError as err:  # a rank forked from a process that had started CUDA cannot start it (pool.py)
        raise RuntimeError(f"CUDA did not start on {device} in rank {os.environ.get('RANK')} ({err}): the process "
                           f"it was forked from had started CUDA first") from err
    return device


def join_store(host: str, port: int, prefix: str, rank: int, world_size: int, gpu: bool,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Create the default process group at a store another process hosts (a served job's front, for the ranks of
    one group across machines), its keys under `prefix` so that many groups and restarts share one store. The
    GPU is LOCAL_RANK's, as under torchrun."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore(prefix, dist.TCPStore(host, port, is_master=False, timeout=timeout))
    dist.init_process_group("nccl" if gpu else "gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timeout, device_id=_own_gpu() if gpu else None)


def _release_at_exit() -> None:
    """Destroy a gloo process group still up when the interpreter exits, while torch.distributed is whole: an
    error that ends a script keeps our groups alive in its traceback until after that, and gloo then aborts
    the process ('terminate called') instead of exiting with the error. (NCCL groups are left to torch.)"""
    if dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()


atexit.register(_release_at_exit)
