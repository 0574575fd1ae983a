"""What every launched process of a served job across machines runs: a host that connects to the front (node 0's
join port, remote.py), says its slot (its global rank), and for each group it is in spawns that group's rank
process (rank.py's loop) and relays between the two.

The host itself never joins a process group and never runs a collective, so it outlives its groups: a group
that fails is stopped by killing its rank processes, and the launcher (torchrun), which stops a whole node when
one of its processes exits, sees nothing. The host exits when the front says goodbye (0), when the front is gone
(1), or when its launcher is (the rank processes follow their host within a second).
"""
from __future__ import annotations

import os
import queue
import threading
import time
from functools import partial
from multiprocessing.connection import Client, Connection
from typing import Any

import torch.multiprocessing as mp

from ..core.join import join_store
from .build import import_ahead
from .rank import exit_with, parent_info, serve_rank
from .remote import BEAT_S, join_key

CONNECT_WAIT_S = 600.0  # how long a host tries to reach the front (node 0 may start, or build, later)


def join_group(rank: int, world_size: int, master: str, port: int, prefix: str, gpu: bool, timeout_s: float,
               local_rank: int) -> None:
    """A rank process's join: its group's process group at the front's store; its GPU the host's LOCAL_RANK."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank))
    import torch

    torch.set_num_threads(1)
    join_store(master, port, prefix, rank, world_size, gpu, timeout_s)


class Child:
    """This host's rank process of one pool, and the thread that relays its answers (and its end) to the front."""

    def __init__(self, send: Any, pool: int, rank: int, world: int, master: str, store_port: int, prefix: str,
                 gpu: bool, timeout_s: float):
        ctx = mp.get_context("spawn")
        self.inbox, outbox, self.cancel = ctx.Queue(), ctx.Queue(), ctx.Value("q", 0, lock=False)
        join = partial(join_group, rank, world, master, store_port, prefix, gpu, timeout_s,
                       int(os.environ.get("LOCAL_RANK", 0)))
        self.proc = ctx.Process(target=serve_rank, args=(rank, join, parent_info(), self.inbox, outbox, self.cancel,
                                                          import_ahead if gpu else None),
                                daemon=True)
        self.proc.start()
        self.pool, self.stopped = pool, False
        send("pid", pool, self.proc.pid)
        threading.Thread(target=self._relay, args=(send, outbox), daemon=True).start()

    def _relay(self, send: Any, outbox: Any) -> None:
        while not self.stopped:
            try:
                send("out", self.pool, outbox.get(timeout=0.5))
            except queue.Empty:
                if self.proc.exitcode is not None:
                    if not self.stopped:
                        send("exit", self.pool, self.proc.exitcode)
                    return

    def stop(self, now: bool) -> None:
        """End the rank: at once, or after its collective shutdown (10 s at most)."""
        self.stopped = True
        if self.proc.is_alive():
            if now:
                self.proc.kill()
            else:
                self.inbox.put(None)
        self.proc.join(timeout=2.0 if now else 10.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def connect(master: str, port: int, wait_s: float = CONNECT_WAIT_S) -> Connection:
    """A connection to the front, trying until it listens (ConnectionError past `wait_s`)."""
    ends = time.monotonic() + wait_s
    while True:
        try:
            return Client((master, port), authkey=join_key())
        except (ConnectionRefusedError, OSError) as err:
            if time.monotonic() > ends:
                raise ConnectionError(f"no front answered on {master}:{port} within {wait_s:.0f} s ({err}): start "
                                      f"node 0 with the same --master-addr and --join-port, and check that this "
                                      f"machine reaches it") from None
            time.sleep(0.5)


def run_host(master: str, port: int, slot: int, node: int, watch_parent: bool = True) -> int:
    """Serve the front's groups from this launched process until the front ends (0 when it said goodbye)."""
    if watch_parent:  # the launcher gone (killed): this host and its rank processes go too
        threading.Thread(target=exit_with, args=(os.getppid(),), daemon=True).start()
    conn = connect(master, port)
    lock = threading.Lock()

    def send(*message: Any) -> None:
        with lock:
            conn.send(message)

    def beat() -> None:
        try:
            while True:
                send("beat")
                time.sleep(BEAT_S)
        except (OSError, ValueError):
            return

    send("hello", slot, node, os.getpid())
    threading.Thread(target=beat, daemon=True).start()
    child: Child | None = None
    try:
        while True:
            kind, *rest = conn.recv()
            if kind == "bye":
                return 0
            if kind == "start":
                if child is not None:
                    child.stop(now=True)
                pool, rank, world, store_port, prefix, gpu, timeout_s = rest
                child = Child(send, pool, rank, world, master, store_port, prefix, gpu, timeout_s)
            elif child is None or rest[0] != child.pool:
                continue  # an old pool's message
            elif kind == "task":
                child.inbox.put(rest[1])
            elif kind == "cancel":
                child.cancel.value = rest[1]
            elif kind == "stop":
                child.stop(now=rest[1])
    except (EOFError, OSError):
        return 1
    finally:
        if child is not None:
            child.stop(now=True)
        conn.close()


__all__ = ["connect", "join_group", "run_host"]
