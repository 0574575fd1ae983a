"""How many bytes one peer can send this rank in one `sp_attention` call: what one-sided transports size
their receive mailboxes (and `streamfusion launch` the NVSHMEM symmetric heap) by.

Two ranks share at most one mesh dimension (they differ in exactly one of t, u, r), so a peer is an
intra-Ulysses, a torus or a ring peer, never two of them; every pair also meets in the joint all-gather.
The bound depends only on the layout and every rank's slice length, so every rank computes the same number.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..core.config import Layout
from ..core.sequence import split_sizes


def peer_bytes(layout: Layout, seq_lens: Sequence[int], batch: int, heads: int, head_dim: int,
               joint_len: int, itemsize: int) -> int:
    """Upper bound on the bytes any one peer sends any one rank in one attention layer.

    Intra-Ulysses peer: its Q, K, V slice (scatter_heads) and the output back (gather_heads).
    Torus peer: Q, then K and V, then O of one sequence part. Ring peer: its K and V of one sequence part
    in each of the T ring passes (one in Pull Q, T - 1 in Pull KV). Everyone: the joint output rows.
    """
    n_t, n_u, n_r = layout.torus, layout.ulysses_intra, layout.ring
    head_part = batch * (heads // layout.ulysses) * head_dim * itemsize  # one token, one rank's heads
    part = max(sum(seq_lens[layout.rank(t, u, r)] for u in range(n_u)) for t in range(n_t) for r in range(n_r))
    per_kind = [
        4 * max(seq_lens) * n_t * head_part if n_u > 1 else 0,
        4 * part * head_part if n_t > 1 else 0,
        2 * n_t * part * head_part if n_r > 1 else 0,
    ]
    joint = max(split_sizes(joint_len, n_r)) * head_part if joint_len else 0
    return max(per_kind) + joint
