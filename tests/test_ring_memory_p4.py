"""Ring and Torus hold, besides a rank's own K/V, two peer blocks per ring at most (the one in use and the one
arriving), and one set at a time where a later Torus stage attends to it again (4 gloo processes): counted
as the receive buffers of the ring group still alive while the layer runs, and for Torus stages as the key
blocks attended (through the context's schedule hook) still alive."""
from __future__ import annotations

import weakref

import pytest
import torch

from streamfusion_diffusers import ParallelConfig, init_parallel, sp_attention
from streamfusion_diffusers.attention.faults import Exact
from streamfusion_diffusers.runtime.pool import ProcessPool

WORLD = 4


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD, timeout_s=60) as p:
        yield p


class HeldBlocks:
    """The context's transport, counting the live buffers it handed out for `group` (K and V of one block)."""

    def __init__(self, inner, group):
        self.inner, self.group = inner, group
        self.live = self.peak = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def recv_buffer(self, like, shape, peer, group):
        buffer = self.inner.recv_buffer(like, shape, peer, group)
        if group is self.group:
            self.live += 1
            self.peak = max(self.peak, self.live)
            weakref.finalize(buffer, self._freed)
        return buffer

    def _freed(self) -> None:
        self.live -= 1


def peak_peer_blocks(config: ParallelConfig, joint: int) -> int:
    """The most ring peer blocks this rank held at once during one attention layer."""
    heads, ctx = 4, init_parallel(config)
    counter = HeldBlocks(ctx.transport, ctx.mesh(heads).ring)
    ctx.transport = counter
    try:
        q, k, v = (torch.randn(1, 8, heads, 16) for _ in range(3))
        jq, jk, jv = (torch.randn(1, joint, heads, 16) for _ in range(3))
        sp_attention(q, k, v, ctx, joint_q=jq, joint_k=jk, joint_v=jv)
    finally:
        ctx.transport = counter.inner
    return counter.peak // 2  # a block is a K and a V buffer


def test_a_ring_pass_holds_two_peer_blocks(pool):
    ring = ParallelConfig(machines=1, gpus_per_machine=WORLD, method="ring")  # R = 4: three peer blocks come
    assert pool.run(peak_peer_blocks, ring, 3) == [2] * WORLD


def test_torus_keeps_one_set_at_a_time(pool):
    torus = ParallelConfig(machines=2, gpus_per_machine=2, method="torus", ulysses=2, torus=2)  # T = 2, R = 2
    assert pool.run(peak_peer_blocks, torus, 3) == [1] * WORLD


class HeldKeys(Exact):
    """The exact schedule hook, counting the key blocks attended that are still alive."""

    def __init__(self):
        self.live = self.peak = 0

    def keys(self, step, blocks, text):
        for k, _ in blocks:
            self.live += 1
            self.peak = max(self.peak, self.live)
            weakref.finalize(k, self._freed)
        return blocks

    def _freed(self) -> None:
        self.live -= 1


def peak_key_blocks(config: ParallelConfig) -> int:
    """The most attended key blocks this rank held at once during one attention layer (no joint tokens)."""
    ctx = init_parallel(config)
    ctx.fault = counter = HeldKeys()
    try:
        sp_attention(*(torch.randn(1, 8, 4, 16) for _ in range(3)), ctx)
    finally:
        ctx.fault = None
    return counter.peak


def test_torus_lets_each_pull_kv_chunk_go(pool):
    """T = 4, R = 1: three Pull KV chunks, only the last kept for Push O. A chunk is let go after its stage (the
    transport may hold its buffer into the next stage's first attention): two at most, not all three."""
    torus = ParallelConfig(machines=2, gpus_per_machine=2, method="torus", ulysses=4, torus=4)
    assert all(held <= 2 for held in pool.run(peak_key_blocks, torus))
