"""Ring attention inside one stage: every ring peer's copy of a key/value set, streamed past local queries.

As in Algorithm 1's RINGATTN, step i takes the block of peer (r + i) % R directly (no forwarding of received
blocks), so each step's transfer is posted while the previous block computes. A peer's block is let go once
attended, so a rank holds, besides its own, two peer blocks at most (the one in use and the one arriving):
memory that does not grow with R. Only a set that a later Torus stage attends to again is kept (`keep`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from ..backends import Handle, Transport
from ..core.mesh import Group
from ..kernels.attend import attend_chunks
from ..kernels.partial import Partial
from .faults import Exact, KVBlock


@dataclass
class Queries:
    """Query chunks that attend together, each with its running Partial."""

    chunks: list[Tensor]
    partials: list[Partial]

    def attend(self, blocks: Sequence[KVBlock], scale: float | None, kernel: str, last: bool = False) -> None:
        """last: no more key/value blocks will come for these queries (their outputs are final)."""
        attend_chunks(self.partials, self.chunks, blocks, scale, kernel, finalize=last)


def _post_step(kv: KVBlock, step: int, peer_lens: Sequence[int], ring: Group, transport: Transport
               ) -> tuple[KVBlock, Handle]:
    size, me = ring.size, ring.index
    src, dst = (me + step) % size, (me - step) % size
    k, v = kv
    shape = (k.shape[0], peer_lens[src], *k.shape[2:])
    k_buf, v_buf = transport.recv_buffer(k, shape, src, ring), transport.recv_buffer(v, shape, src, ring)
    handle = transport.exchange([(k, dst), (v, dst)], [(k_buf, src), (v_buf, src)], ring)
    return (k_buf, v_buf), handle


def ring_attend(queries: Queries, kv: KVBlock, peer_lens: Sequence[int], ring: Group, transport: Transport,
                scale: float | None, kernel: str, fault: Exact, extra: Sequence[KVBlock] = (), last: bool = False,
                keep: bool = False) -> list[KVBlock]:
    """Attend `queries` to the union of every ring peer's `kv` (peer j holds peer_lens[j] tokens) plus `extra`
    (the joint text keys, which lead this rank's own step).

    last: this set is the queries' final one (their outputs are finished by the last ring step).
    keep: return every block attended (extra and this rank's own first) for a later stage; else nothing.
    """
    text = sum(k.shape[1] for k, _ in extra)
    own = fault.keys(0, [*extra, kv], text)
    kept = list(own) if keep else []
    pending = _post_step(kv, 1, peer_lens, ring, transport) if ring.size > 1 else None
    queries.attend(own, scale, kernel, last and ring.size == 1)
    for step in range(1, ring.size):
        block, handle = pending
        pending = _post_step(kv, step + 1, peer_lens, ring, transport) if step + 1 < ring.size else None
        handle.wait()
        blocks = fault.keys(step, [block], 0)
        queries.attend(blocks, scale, kernel, last and step + 1 == ring.size)
        kept += blocks if keep else []
        del block, blocks  # let this peer's block go before the next one is posted
    return kept
