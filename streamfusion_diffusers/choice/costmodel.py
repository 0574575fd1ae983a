"""A cost model of our schedules: per-rank transfers and attention work, turned into time.

It walks the same schedule `sp_attention` runs (scatter heads, Pull Q / Pull KV / Push O stages with a ring
pass inside each, gather heads) for every rank of a layout, classifies each transfer as intra- or
inter-machine by the ranks' machines, and overlaps transfers with the attention they hide behind. Volumes and
message counts are the transport's (one message per tensor posted) and exact for even slices; times depend on
the `Gpu` figures, which are calibrated from measurements. `link_bound` is the least time the busiest rank's
inter-machine transfers take on the link alone, whatever overlaps them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..core.config import Layout, ParallelConfig, divisors, resolve_layout
from ..core.links import NVLINK, Link
from .workloads import Workload


@dataclass(frozen=True)
class Gpu:
    """Throughputs of one GPU and its intra-machine link. Defaults: one H200. Attention rates are what a whole
    layer's attention reaches (the no-comm bound rows of `streamfusion bench`), not a small shape's peak, which
    predicts every emulated run faster than it runs."""

    # head dim -> TFLOP/s: the no-comm bound rows of benchmarks/results/2026-11-22-h200x2/
    attention_tflops: dict[int, float] = field(default_factory=lambda: {64: 430.0, 128: 620.0})
    gemm_tflops: float = 700.0
    hbm_gb_per_s: float = 4000.0
    launch_us: float = 6.0
    intra: Link = NVLINK
    stage_us: float = 0.0  # fixed cost of each group of transfers posted together (sync, bookkeeping)
    layer_us: float = 0.0  # fixed cost of one sp_attention call (Python, layout checks, buffers)
    inter_latency_us: float = 0.0  # per message between machines, beyond the link's own latency (transport)
    overlap: float = 1.0  # share of the shorter of a stage's compute and transfer that the longer one hides

    def hidden(self, compute: float, transfer: float) -> float:
        """Seconds of a stage whose compute and transfer run side by side."""
        return max(compute, transfer) + (1.0 - self.overlap) * min(compute, transfer)

    def attention_s(self, flops: float, head_dim: int) -> float:
        tflops = self.attention_tflops.get(head_dim) or min(self.attention_tflops.values())
        return flops / (tflops * 1e12)


@dataclass(frozen=True)
class LinkBound:
    """What the busiest rank sends across machines in one attention layer, and the time the link alone needs for
    it (bytes over bandwidth plus latency per message): no schedule can finish the layer sooner."""

    bytes_per_gpu: float
    messages: int
    seconds: float


@dataclass
class Prediction:
    """Predicted cost of one layout on the busiest rank."""

    layout: Layout
    inter_machine_bytes_per_gpu: float
    intra_machine_bytes_per_gpu: float
    layer_ms: float
    step_ms: float
    link: LinkBound

    def as_dict(self) -> dict:
        lay = self.layout
        return {"ulysses": lay.ulysses, "ring": lay.ring, "torus": lay.torus,
                "inter_machine_bytes_per_gpu": round(self.inter_machine_bytes_per_gpu),
                "intra_machine_bytes_per_gpu": round(self.intra_machine_bytes_per_gpu),
                "inter_machine_messages": self.link.messages, "link_bound_ms": round(self.link.seconds * 1e3, 4),
                "layer_ms": round(self.layer_ms, 4), "step_ms": round(self.step_ms, 3)}


class _Rank:
    """One rank walking the schedule: accumulates its time, and its bytes and messages per link class."""

    def __init__(self, rank: int, lay: Layout, w: Workload, gpu: Gpu, inter: Link, elem_bytes: int):
        self.rank, self.lay, self.w, self.gpu, self.inter = rank, lay, w, gpu, inter
        self.t, self.u, self.r = lay.coords(rank)
        self.s = w.tokens / lay.world_size  # tokens per rank
        self.lp = self.s * lay.ulysses_intra  # tokens of one sequence part after the intra-Ulysses all-to-all
        self.h = w.heads // lay.ulysses
        self.elem = elem_bytes
        self.joint_rows = w.text_tokens / lay.ring
        self.bytes = {"intra": 0.0, "inter": 0.0}
        self.messages = {"intra": 0, "inter": 0}

    def _link(self, peer: int) -> tuple[str, Link]:
        same = peer // self.lay.gpus_per_machine == self.rank // self.lay.gpus_per_machine
        return ("intra", self.gpu.intra) if same else ("inter", self.inter)

    def send(self, transfers: list[tuple[int, float, int]]) -> float:
        """Transfers posted together (peer, elements, tensors): time until the last lands, links used in
        parallel. Each tensor is a message of its own on the wire, as the transports post them."""
        per_link: dict[str, tuple[float, int]] = {}
        for peer, elements, tensors in transfers:
            kind, _ = self._link(peer)
            self.bytes[kind] += elements * self.elem
            self.messages[kind] += tensors
            nbytes, messages = per_link.get(kind, (0.0, 0))
            per_link[kind] = (nbytes + elements * self.elem, messages + tensors)
        stage = self.gpu.stage_us * 1e-6 if per_link else 0.0
        extra = {"intra": 0.0, "inter": self.gpu.inter_latency_us * 1e-6}
        return stage + max((({"intra": self.gpu.intra, "inter": self.inter})[k].seconds(nbytes, messages)
                            + messages * extra[k] for k, (nbytes, messages) in per_link.items()), default=0.0)

    def attend(self, rows: float, key_blocks: list[float]) -> float:
        """Launch-and-merge attention of `rows` queries over K/V blocks (the unfused kernel path)."""
        w, gpu = self.w, self.gpu
        total = 0.0
        for i, keys in enumerate(key_blocks):
            flops = 4.0 * w.batch * rows * keys * self.h * w.head_dim
            merge = 0.0 if i == 0 else 3 * 4 * w.batch * rows * self.h * w.head_dim / (gpu.hbm_gb_per_s * 1e9)
            total += gpu.attention_s(flops, w.head_dim) + merge + gpu.launch_us * 1e-6
        return total

    def ring_pass(self, rows: float, extra_keys: float = 0.0) -> float:
        """Rows against every ring peer's block of lp keys; block i+1 travels while block i computes."""
        lay, r = self.lay, self.r
        kv = 2 * self.w.batch * self.lp * self.h * self.w.head_dim
        computes = [self.attend(rows, [extra_keys, self.lp] if extra_keys else [self.lp])]
        computes += [self.attend(rows, [self.lp]) for _ in range(1, lay.ring)]
        total = 0.0
        for step in range(1, lay.ring):
            peer = lay.rank(self.t, self.u, (r + step) % lay.ring)
            total += self.gpu.hidden(computes[step - 1], self.send([(peer, kv, 2)]))  # K and V
        return total + computes[-1]

    def layer(self) -> float:
        lay, w, t = self.lay, self.w, self.t
        n = lay.torus
        chunk = w.batch * self.lp * self.h * w.head_dim  # elements of one torus chunk T_{l,h}
        peers_u = [lay.rank(t, u, self.r) for u in range(lay.ulysses_intra) if u != self.u]
        slice_heads = w.batch * self.s * n * self.h * w.head_dim  # one rank's slice, one peer's heads
        torus_peer = [lay.rank((t + k) % n, self.u, self.r) for k in range(n)]
        time = self.send([(p, 3 * slice_heads, 1) for p in peers_u])  # scatter heads: q, k, v packed per peer
        for k in range(1, n + 1):  # Pull Q
            transfer = self.send([(torus_peer[k], chunk, 1)]) if k < n else (
                self.send([(torus_peer[1], 2 * chunk, 2)]) if n > 1 else 0.0)
            if k == 1:
                compute = self.ring_pass(self.lp + self.joint_rows, extra_keys=w.text_tokens)
            else:
                compute = self.attend(self.lp, [w.text_tokens] + [self.lp] * lay.ring)
            time += self.gpu.hidden(compute, transfer)
        for k in range(1, n):  # Pull KV
            transfer = self.send([(torus_peer[k + 1], 2 * chunk, 2)]) if k + 1 < n else 0.0
            time += self.gpu.hidden(self.ring_pass((n - 1) * self.lp + self.joint_rows), transfer)
        if n > 1:  # Push O
            transfer = self.send([(torus_peer[k], chunk, 1) for k in range(1, n)])
            time += self.gpu.hidden(self.attend(self.lp, [self.lp] * ((n - 1) * lay.ring)), transfer)
        time += self.send([(p, slice_heads, 1) for p in peers_u])  # gather heads: o packed per peer
        if w.text_tokens:  # joint output all-gather over the world, each share padded to the longest
            share = w.batch * -(-w.text_tokens // lay.ring) * self.h * w.head_dim
            time += self.send([(p, share, 1) for p in range(lay.world_size) if p != self.rank])
        return time


def _walked(lay: Layout, w: Workload, inter: Link, gpu: Gpu, elem_bytes: int) -> tuple[list[_Rank], list[float]]:
    """Every rank after one attention layer, and each one's seconds for it."""
    ranks = [_Rank(rank, lay, w, gpu, inter, elem_bytes) for rank in range(lay.world_size)]
    return ranks, [r.layer() + gpu.layer_us * 1e-6 for r in ranks]


def _on_link(ranks: list[_Rank], link: Link) -> LinkBound:
    """The link bound of the rank whose inter-machine transfers take the link longest."""
    seconds = [link.seconds(r.bytes["inter"], r.messages["inter"]) for r in ranks]
    busiest = max(range(len(ranks)), key=lambda i: seconds[i])
    return LinkBound(ranks[busiest].bytes["inter"], ranks[busiest].messages["inter"], seconds[busiest])


def link_bound(lay: Layout, w: Workload, link: Link, elem_bytes: int = 2) -> LinkBound:
    """Bytes and messages the busiest rank sends across machines in one attention layer, and the seconds the
    link takes for them alone (as an emulated link books them: one queue per rank, one message after another)."""
    return _on_link(_walked(lay, w, link, Gpu(), elem_bytes)[0], link)


def predict(lay: Layout, w: Workload, inter: Link, gpu: Gpu | None = None, elem_bytes: int = 2) -> Prediction:
    """Predicted attention-layer and step time of one layout (the busiest rank's), and its link bound."""
    gpu = gpu or Gpu()
    ranks, layers = _walked(lay, w, inter, gpu, elem_bytes)
    busiest = max(range(len(ranks)), key=lambda i: layers[i])
    tokens = w.tokens / lay.world_size + w.text_tokens
    gemm_s = w.batch * tokens * w.block_flops_per_token / (gpu.gemm_tflops * 1e12)
    return Prediction(lay, max(r.bytes["inter"] for r in ranks), max(r.bytes["intra"] for r in ranks),
                      layers[busiest] * 1e3, w.blocks * (layers[busiest] + gemm_s) * 1e3, _on_link(ranks, inter))


def candidate_layouts(method: str, machines: int, gpus_per_machine: int, heads: int) -> list[Layout]:
    """Every valid UxR (and Torus degree) of a method on N x M GPUs."""
    p = machines * gpus_per_machine
    if method in ("ulysses", "ring"):
        configs = [ParallelConfig(machines=machines, gpus_per_machine=gpus_per_machine, method=method)]
    else:
        us = [u for u in divisors(p) if heads % u == 0]
        configs = [ParallelConfig(machines=machines, gpus_per_machine=gpus_per_machine, method=method, ulysses=u,
                                  torus=t if method == "torus" else None)
                   for u in us for t in (divisors(u) if method == "torus" else [None])]
    out = []
    for config in configs:
        try:
            out.append(resolve_layout(config, p, heads))
        except ValueError:
            continue
    return out
