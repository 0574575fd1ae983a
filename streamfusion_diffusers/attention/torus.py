"""Torus attention (paper Section 4.3 and Algorithm 1), over a two-sided transport.

T_{l,h}: sequence part l, head part h; this rank is t in its torus group of T. Inputs are already through
the intra-Ulysses all-to-all: Q, K, V as [T, B, L_t, h, D], head part tau = x[tau]. The inter-part all-to-all
is split into stages that each overlap a transfer with attention on chunks already present:

- Pull Q (T stages): stage k attends Q_{(t-k+1),t} to the stationary K_{t,t}, V_{t,t} while Q_{t,(t+k)}
  travels to rank t+k; the last stage sends the first K, V chunk instead.
- Pull KV (T-1 stages): stage k attends every received Q_{l,t} (l != t) to K_{(t-k),t}, V_{(t-k),t} while the
  next K, V chunk travels; partials are merged by log-sum-exp. Q_{t,t} joins every stage but the last.
- Push O: O_{l,t} (l != t) is final and travels back to rank l while O_{t,t} is finished against the
  K, V chunk of the last Pull KV stage, the one set kept for it.

Every "attend to a K, V chunk" is a ring pass over the ring group (ring.py). With T = 1 the schedule is one
ring pass over local chunks, which is how Ulysses, Ring, USP and TAS run through this same code.
Memory: besides its own K, V, a rank keeps one set of every ring peer's blocks at a time, and only where a
later stage attends to it again (the stationary set through Pull Q, the last Pull KV set for Push O); every
other ring pass holds two peer blocks at most.
Joint (replicated text) tokens: their K, V join the stationary set, so each query sees them exactly once;
their queries are split over the ring peers and attend to the stationary set and every Pull KV chunk.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from ..backends import Handle, Transport
from ..backends.watch import stage
from ..core.mesh import Mesh
from ..kernels.partial import Partial
from .faults import EXACT, Exact
from .ring import KVBlock, Queries, ring_attend


def finished(partial: Partial, q: Tensor) -> Tensor:
    """The attention output of query chunk q in q's dtype (empty when the chunk has no rows)."""
    return q.new_empty(q.shape) if q.shape[1] == 0 else partial.result(q.dtype)


@dataclass
class JointShard:
    """This rank's share of the joint tokens: query rows split over ring peers, K, V of its heads, all rows."""

    q: Tensor
    k: Tensor
    v: Tensor
    partial: Partial


class TorusSchedule:
    """One Torus attention layer on this rank; `run()` returns O_{t,:} as T tensors [B, L_t, h, D], head part
    tau at index tau (a list, so that received parts stay where the transport put them)."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, mesh: Mesh, transport: Transport,
                 seq_lens: Sequence[int], joint: JointShard | None, scale: float | None, kernel: str,
                 fault: Exact = EXACT):
        self.q, self.k, self.v = q, k, v
        self.mesh, self.transport, self.joint = mesh, transport, joint
        self.scale, self.kernel, self.fault = scale, kernel, fault
        self.n, self.t = mesh.layout.torus, mesh.t
        ring = mesh.layout.ring
        # part_lens[l][j]: tokens of sequence part l on ring peer j (every rank knows every length)
        self.part_lens = [[mesh.part_len(seq_lens, l, j) for j in range(ring)] for l in range(self.n)]
        self.partials = [Partial() for _ in range(self.n)]
        self.q_chunks: dict[int, Tensor] = {self.t: q[self.t]}  # Q_{l,t} by sequence part l
        self.last_set: list[KVBlock] = []  # the last Pull KV stage's K, V chunk, every ring peer's copy

    def run(self) -> list[Tensor]:
        with self._stage("pull_q"):
            kv_in_flight = self.pull_q()
        with self._stage("pull_kv"):
            self.pull_kv(kv_in_flight)
        with self._stage("push_o"):
            return self.push_o()

    def _stage(self, name: str):
        """Label this stage's transfers (errors name it); with T = 1 there are no stages, only a ring pass."""
        return stage(name if self.n > 1 else "")

    # --- transfers ---------------------------------------------------------------------------------------
    def _recv_len(self, part: int) -> int:
        return self.part_lens[part][self.mesh.r]

    def _send_q(self, k: int) -> tuple[int, Tensor, Handle]:
        """Q_{t,(t+k)} to rank t+k; Q_{(t-k),t} from rank t-k."""
        dst, src = (self.t + k) % self.n, (self.t - k) % self.n
        buf = self.transport.recv_buffer(self.q, (self.q.shape[1], self._recv_len(src), *self.q.shape[3:]), src,
                                         self.mesh.torus)
        return src, buf, self.transport.exchange([(self.q[dst], dst)], [(buf, src)], self.mesh.torus)

    def _send_kv(self, k: int) -> tuple[int, KVBlock, Handle]:
        """K, V_{t,(t+k)} to rank t+k; K, V_{(t-k),t} from rank t-k."""
        dst, src = (self.t + k) % self.n, (self.t - k) % self.n
        shape = (self.k.shape[1], self._recv_len(src), *self.k.shape[3:])
        torus, recv_buffer = self.mesh.torus, self.transport.recv_buffer
        k_buf, v_buf = recv_buffer(self.k, shape, src, torus), recv_buffer(self.v, shape, src, torus)
        handle = self.transport.exchange([(self.k[dst], dst), (self.v[dst], dst)],
                                         [(k_buf, src), (v_buf, src)], self.mesh.torus)
        return src, (k_buf, v_buf), handle

    def _ring(self, queries: Queries, kv: KVBlock, part: int, extra: Sequence[KVBlock] = (),
              last: bool = False, keep: bool = False) -> list[KVBlock]:
        return ring_attend(queries, kv, self.part_lens[part], self.mesh.ring, self.transport,
                           self.scale, self.kernel, self.fault, extra, last, keep)

    # --- stages ------------------------------------------------------------------------------------------
    def pull_q(self) -> tuple[int, KVBlock, Handle] | None:
        """T stages against the stationary K_{t,t}, V_{t,t} (plus joint K, V); returns the first K, V transfer."""
        t, n = self.t, self.n
        local_blocks: list[KVBlock] = []
        q_in_flight = kv_in_flight = None
        for k in range(1, n + 1):
            arrived = q_in_flight
            if k < n:
                q_in_flight = self._send_q(k)
            elif n > 1:
                kv_in_flight = self._send_kv(1)
            part = (t - k + 1) % n
            if arrived is not None:
                src, buf, handle = arrived
                handle.wait()
                self.q_chunks[src] = buf
            queries = Queries([self.q_chunks[part]], [self.partials[part]])
            if k == 1:
                joint_kv = []
                if self.joint is not None:
                    queries.chunks.append(self.joint.q)
                    queries.partials.append(self.joint.partial)
                    joint_kv = [(self.joint.k, self.joint.v)]
                # with T = 1 this ring pass is every key the queries see (Ulysses, USP): it finishes them;
                # with T > 1 the later stages attend to the same set, so it is kept until Pull Q ends
                local_blocks = self._ring(queries, (self.k[t], self.v[t]), t, joint_kv, last=n == 1, keep=n > 1)
            else:
                queries.attend(local_blocks, self.scale, self.kernel)
        return kv_in_flight

    def pull_kv(self, kv_in_flight: tuple[int, KVBlock, Handle] | None) -> None:
        """T-1 stages: every received Q_{l,t} (and the joint queries) against K_{(t-k),t}, V_{(t-k),t}; Q_{t,t}
        too, but for the last stage, whose set is kept for Push O."""
        others = [(self.t - k) % self.n for k in range(1, self.n)]
        queries = Queries([self.q_chunks[l] for l in others], [self.partials[l] for l in others])
        if self.joint is not None:
            queries.chunks.append(self.joint.q)
            queries.partials.append(self.joint.partial)
        with_own = Queries([*queries.chunks, self.q_chunks[self.t]], [*queries.partials, self.partials[self.t]])
        for k in range(1, self.n):
            src, kv, handle = kv_in_flight
            kv_in_flight = self._send_kv(k + 1) if k + 1 < self.n else None
            handle.wait()
            last = k + 1 == self.n
            self.last_set = self._ring(queries if last else with_own, kv, src, keep=last)
            del kv  # this chunk's own copy goes with its stage

    def push_o(self) -> list[Tensor]:
        """Send the finished O_{l,t} home while O_{t,t} attends to the K, V received in Pull KV."""
        t, n = self.t, self.n
        shape = (self.q.shape[1], self._recv_len(t), *self.q.shape[3:])
        out = [self.transport.recv_buffer(self.q, shape, l, self.mesh.torus) if l != t else None for l in range(n)]
        sends = [(finished(self.partials[l], self.q_chunks[l]), l) for l in range(n) if l != t]
        recvs = [(out[l], l) for l in range(n) if l != t]
        handle = self.transport.exchange(sends, recvs, self.mesh.torus) if n > 1 else None
        Queries([self.q_chunks[t]], [self.partials[t]]).attend(self.last_set, self.scale, self.kernel)
        self.last_set = []
        out[t] = finished(self.partials[t], self.q_chunks[t])
        if handle is not None:
            handle.wait()
        return out
