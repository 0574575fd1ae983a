"""The front's side of a served job across machines: the launched processes of every node connect to it, and it
runs their replica groups as pools.

Under `streamfusion launch` (torchrun) every launched process of every node runs `serve`; the one of global rank 0
is the front (HTTP, queue, batching), and every one, the front's too, is a host (host.py) that connects to the
front's join port on node 0 and says its slot (its global rank). A group's pool (`RemotePool`) asks its slots'
hosts each to spawn a rank process that joins the group's own process group at the front's store, then speaks
the local pool's protocol (pool.py) over those connections. Why this shape: the launched processes never join
one process group of the whole job, so a node that dies takes down only the groups it is in; they outlive their
groups' rank processes (torchrun stops every process of a node when one exits, and with them the node's other
groups); and the front sees a host gone (its connection closed) or stalled (no heartbeat for STALL_S) within
seconds, without waiting on any collective. A host that connects again (its launcher restarted) takes its slot
back, and the groups that wait for it start again. What travels is wire.py's typed messages, after its
handshake: a process that cannot prove the job's secret, or that breaks the protocol, is dropped unheard.
"""
from __future__ import annotations

import datetime
import inspect
import itertools
import logging
import math
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from . import wire, worker
from .pool import Pool, RankFailure, exit_cause

logger = logging.getLogger(__name__)

BEAT_S = 1.0  # how often a host says it is alive
STALL_S = 6.0  # a host silent this long is stalled: its groups fail
HELLO_S = 10.0  # how long a new connection may take to prove the secret and say its slot
CALLS: dict[Callable, type[wire.Message]] = {worker.build: wire.Build, worker.warm_up: wire.WarmUp,
                                             worker.run: wire.Run}  # what a remote pool's ranks may run


class Link:
    """One host's connection to the front: what it says reaches the pool it serves now."""

    def __init__(self, channel: wire.Channel, slot: int, node: int, pid: int):
        self.channel, self.slot, self.node, self.pid = channel, slot, node, pid
        self.last_seen = time.monotonic()
        self.closed: str | None = None  # why the connection ended
        self.pool: RemotePool | None = None
        threading.Thread(target=self._read, daemon=True, name=f"streamfusion-link-{slot}").start()

    def send(self, message: wire.Message) -> None:
        try:
            self.channel.send(message)
        except OSError as err:
            self.closed = self.closed or f"its connection failed ({err})"

    def _read(self) -> None:
        try:
            while True:
                message = self.channel.receive()
                self.last_seen = time.monotonic()
                pool = self.pool
                if pool is None or getattr(message, "pool", None) != pool.id:
                    continue  # a beat, or an old pool's message
                rank = pool.links.index(self)
                if isinstance(message, wire.ANSWERS):
                    pool._outbox.put((rank, *wire.received(message)))
                elif isinstance(message, wire.Spawned):
                    pool.child_pids[rank] = message.pid
                elif isinstance(message, wire.Exited):
                    pool.exits[rank] = message.code
        except wire.WireError as err:
            logger.warning("rank %d's host was dropped: %s", self.slot, err)
            self.close(f"it broke the join protocol ({err})")
        except (EOFError, OSError) as err:
            self.closed = self.closed or f"its connection closed ({type(err).__name__})"

    def gone(self) -> str | None:
        """Why this host no longer serves (None while it does)."""
        if self.closed is not None:
            return self.closed
        silent = time.monotonic() - self.last_seen
        return f"no heartbeat for {silent:.0f} s (stalled)" if silent > STALL_S else None

    def close(self, why: str) -> None:
        self.closed = self.closed or why
        self.channel.close()


class Front:
    """Node 0's join port, the store the groups' process groups meet at (port + 1), and the hosts connected.
    `secret`: the job's (wire.join_secret), required unless the port is on loopback."""

    def __init__(self, host: str, port: int, world: int, per_machine: int, timeout_s: float,
                 secret: bytes | None):
        # other machines' hosts reach node 0 at its address; launchers that meet on loopback keep the port there
        bind = host if wire.local_only(host) else "0.0.0.0"
        wire.require_secret(secret, bind)
        self.world, self.per_machine, self.port, self.store_port = world, per_machine, port, port + 1
        self.links: dict[int, Link] = {}
        self.closed = False
        self._secret = secret
        self._changed = threading.Condition()
        self._listener = socket.create_server((bind, port), backlog=max(world, 16))
        self.store = dist.TCPStore(host, self.store_port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        threading.Thread(target=self._accept, daemon=True, name="streamfusion-join").start()

    def _accept(self) -> None:
        while True:
            try:
                sock, address = self._listener.accept()
            except OSError:  # the listener closed
                return
            threading.Thread(target=self._hello, args=(wire.Channel(sock), address[0]), daemon=True).start()

    def _hello(self, channel: wire.Channel, address: str) -> None:
        """Admit a host that proves the secret and says a slot of this job; drop anything else, unheard."""
        try:
            channel.sock.settimeout(HELLO_S)
            wire.check_host(channel, self._secret)
            hello = channel.expect(wire.Hello)
            if hello.slot >= self.world:
                raise wire.WireError(f"slot {hello.slot} is not in this job's 0 .. {self.world - 1}")
            channel.sock.settimeout(None)
        except (wire.WireError, EOFError, OSError) as err:
            logger.warning("a connection to the join port from %s was refused: %s", address, err)
            channel.close()
            return
        with self._changed:
            if (old := self.links.get(hello.slot)) is not None:
                old.close("a new process took its slot (its launcher restarted)")
            self.links[hello.slot] = Link(channel, hello.slot, hello.node, hello.pid)
            self._changed.notify_all()
        logger.info("rank %d of node %d joined", hello.slot, hello.node)

    def missing(self, slots: Sequence[int]) -> list[int]:
        """The slots with no live host now."""
        return [s for s in slots if (link := self.links.get(s)) is None or link.gone()]

    def wait_for(self, slots: Sequence[int], stopped: Callable[[], bool]) -> list[Link]:
        """The slots' hosts, once every one is connected and alive; RankFailure once `stopped()`."""
        with self._changed:
            while self.missing(slots):
                if stopped() or self.closed:
                    raise RankFailure("waiting for the nodes", dict.fromkeys(self.missing(slots), "stopped"), set())
                self._changed.wait(0.5)
            return [self.links[s] for s in slots]

    def close(self) -> None:
        """Say goodbye to every host (they exit 0) and stop listening."""
        self.closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (a close alone may not)
        except OSError:
            pass
        self._listener.close()
        for link in list(self.links.values()):
            link.send(wire.Bye())
            link.close("the front closed")


@dataclass(frozen=True)
class Hosts:
    """One group's slots (global ranks, rank order) and the front their hosts join: what a group spanning
    launched processes starts its pool from."""

    front: Front
    slots: tuple[int, ...]

    def missing(self) -> list[int]:
        return self.front.missing(self.slots)

    def nodes(self, slots: Sequence[int] | None = None) -> list[int]:
        """The nodes of these slots (default: the group's)."""
        return sorted({s // self.front.per_machine for s in (self.slots if slots is None else slots)})

    def pool(self, gpu: bool, timeout_s: float, stopped: Callable[[], bool]) -> RemotePool:
        """The group's pool, once every slot's host is connected (RankFailure once `stopped()`)."""
        return RemotePool(self.front, self.front.wait_for(self.slots, stopped), gpu, timeout_s, math.inf)


class RemotePool(Pool):
    """A pool whose ranks are spawned by hosts (rank r by links[r]), joined at the front's store."""

    _ids = itertools.count(1)
    grace_s = 1.0  # a lost node's peers wait in a collective on it: their errors say nothing more, and come late

    def __init__(self, front: Front, links: list[Link], gpu: bool, timeout_s: float, wait_s: float | None):
        super().__init__(len(links), timeout_s, wait_s)
        self.id = next(self._ids)
        self.links = links
        self._outbox = queue.Queue()
        self.child_pids: dict[int, int] = {}
        self.exits: dict[int, int] = {}
        for rank, link in enumerate(links):
            link.pool = self
            link.send(wire.Start(self.id, rank, len(links), front.store_port, f"streamfusion/pool{self.id}/", gpu,
                                 timeout_s))

    @property
    def pids(self) -> list[int]:
        return [self.child_pids.get(r, 0) for r in range(self.world_size)] if not self._closed else []

    def _ended(self) -> dict[int, str]:
        ended = {}
        for rank, link in enumerate(self.links):
            if rank in self.exits:
                ended[rank] = f"{exit_cause(self.exits[rank])} (rank {link.slot} of the job, node {link.node})"
            elif (why := link.gone()) is not None:
                ended[rank] = f"node {link.node} lost: its rank {link.slot}'s host: {why}"
        return ended

    def _post(self, task: tuple | None) -> None:
        """The task as its typed message (CALLS: what the ranks may run), to every host."""
        assert task is not None, "a remote pool's ranks end by `close`"
        call, fn, args, kwargs = task
        if fn not in CALLS:
            raise ValueError(f"{getattr(fn, '__name__', fn)} cannot run on ranks across machines: only "
                             f"{', '.join(f.__name__ for f in CALLS)} can")
        message = CALLS[fn](self.id, call, **inspect.signature(fn).bind(*args, **kwargs).arguments)
        for link in self.links:
            link.send(message)

    def cancel(self, call: int) -> None:
        """As ProcessPool.cancel: each host sets its rank's cancel value."""
        for link in self.links:
            link.send(wire.Cancel(self.id, call))

    def close(self, stop: bool = False) -> None:
        """Ask each host to end its rank: together (a collective shutdown), or with `stop` at once."""
        if stop:
            self._closed = True
            self._outbox.put(None)
        for link in self.links:
            link.send(wire.Stop(self.id, stop))
            if link.pool is self:
                link.pool = None
        self._closed = True


__all__ = ["BEAT_S", "CALLS", "Front", "Hosts", "Link", "RemotePool", "STALL_S"]
