"""What every launched process of a served job across machines runs: a host that connects to the front (node 0's
join port, remote.py), says its slot (its global rank), and for each group it is in spawns that group's rank
process (rank.py's loop) and relays between the two.

The host itself never joins a process group and never runs a collective, so it outlives its groups: a group
that fails is stopped by killing its rank processes, and the launcher (torchrun), which stops a whole node when
one of its processes exits, sees nothing. The host exits when the front says goodbye (0), when the front is gone
(1), or when its launcher is (the rank processes follow their host within a second). It speaks wire.py's typed
messages: a call arrives as its own kind (remote.py's CALLS), a rank's answer leaves as one (`wire.answer`).
"""
from __future__ import annotations

import dataclasses
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from functools import partial

import torch.multiprocessing as mp

from ..core.join import join_store
from . import wire
from .build import import_ahead
from .rank import exit_with, parent_info, serve_rank
from .remote import BEAT_S, CALLS, HELLO_S

Send = Callable[[wire.Message], None]

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

    def __init__(self, send: Send, start: wire.Start, master: str):
        ctx = mp.get_context("spawn")
        self.inbox, outbox, self.cancel = ctx.Queue(), ctx.Queue(), ctx.Value("q", 0, lock=False)
        join = partial(join_group, start.rank, start.world, master, start.store_port, start.prefix, start.gpu,
                       start.timeout_s, int(os.environ.get("LOCAL_RANK", 0)))
        self.proc = ctx.Process(target=serve_rank, args=(start.rank, join, parent_info(), self.inbox, outbox,
                                                          self.cancel, import_ahead if start.gpu else None),
                                daemon=True)
        self.proc.start()
        self.pool, self.stopped = start.pool, False
        send(wire.Spawned(self.pool, self.proc.pid))
        threading.Thread(target=self._relay, args=(send, outbox), daemon=True).start()

    def _relay(self, send: Send, outbox: mp.Queue) -> None:
        while not self.stopped:
            try:
                _, ok, value = outbox.get(timeout=0.5)
            except queue.Empty:
                if self.proc.exitcode is not None:
                    if not self.stopped:
                        send(wire.Exited(self.pool, self.proc.exitcode))
                    return
                continue
            try:
                send(wire.answer(self.pool, ok, value))
            except wire.WireError as err:  # an answer the wire does not carry: the call fails, saying why
                send(wire.Failed(self.pool, f"{type(err).__name__}: {err}"))

    def run(self, call: wire.Message) -> None:
        """Hand a call's message to the rank as its task (call number, function, no args, its fields by name)."""
        fn = next(f for f, kind in CALLS.items() if isinstance(call, kind))
        fields = {f.name: getattr(call, f.name) for f in dataclasses.fields(call) if f.name not in ("pool", "call")}
        self.inbox.put((call.call, fn, (), fields))

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


def connect(master: str, port: int, secret: bytes | None, wait_s: float = CONNECT_WAIT_S) -> wire.Channel:
    """A connection to the front, trying until it listens (ConnectionError past `wait_s`), both sides proved."""
    ends = time.monotonic() + wait_s
    while True:
        try:
            sock = socket.create_connection((master, port), timeout=HELLO_S)
        except OSError as err:
            if time.monotonic() > ends:
                raise ConnectionError(f"no front answered on {master}:{port} within {wait_s:.0f} s ({err}): start "
                                      f"node 0 with the same --master-addr and --join-port, and check that this "
                                      f"machine reaches it") from None
            time.sleep(0.5)
            continue
        channel = wire.Channel(sock)
        try:
            wire.prove_host(channel, secret)
        except (wire.WireError, EOFError, OSError) as err:
            channel.close()
            raise ConnectionError(f"the front on {master}:{port} and this host did not prove the same join secret "
                                  f"({err}): pass the same --join-secret or set the same ${wire.JOIN_KEY_ENV} on "
                                  f"every node") from None
        sock.settimeout(None)
        return channel


def run_host(master: str, port: int, slot: int, node: int, secret: bytes | None, watch_parent: bool = True) -> int:
    """Serve the front's groups from this launched process until the front ends (0 when it said goodbye)."""
    wire.require_secret(secret, master)
    if watch_parent:  # the launcher gone (killed): this host and its rank processes go too
        threading.Thread(target=exit_with, args=(os.getppid(),), daemon=True).start()
    channel = connect(master, port, secret)

    def beat() -> None:
        try:
            while True:
                channel.send(wire.Beat())
                time.sleep(BEAT_S)
        except OSError:
            return

    channel.send(wire.Hello(slot, node, os.getpid()))
    threading.Thread(target=beat, daemon=True).start()
    child: Child | None = None
    try:
        while True:
            message = channel.receive()
            if isinstance(message, wire.Bye):
                return 0
            if isinstance(message, wire.Start):
                if child is not None:
                    child.stop(now=True)
                child = Child(channel.send, message, master)
            elif child is None or getattr(message, "pool", None) != child.pool:
                continue  # an old pool's message
            elif isinstance(message, tuple(CALLS.values())):
                child.run(message)
            elif isinstance(message, wire.Cancel):
                child.cancel.value = message.call
            elif isinstance(message, wire.Stop):
                child.stop(now=message.now)
    except (EOFError, OSError, wire.WireError):
        return 1
    finally:
        if child is not None:
            child.stop(now=True)
        channel.close()


__all__ = ["connect", "join_group", "run_host"]
