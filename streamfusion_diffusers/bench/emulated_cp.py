"""diffusers' context parallelism over the same emulated inter-machine link as ours, for a like-for-like comparison.

diffusers' templated attention moves its tensors with torch's functional collectives (`funcol.all_to_all_single`
for Ulysses, `funcol.all_gather_tensor` for its ring's keys and values), which the emulated link of our transport
(backends/emulated.py) does not see: over emulated machines, diffusers-cp would run as if every GPU shared one
NVLink domain. While `over_emulated_link` is entered, `diffusers.models.attention_dispatch` reaches those
collectives through a proxy that posts each as before and books the bytes it moves between ranks of different
(virtual) machines on the same kind of emulated NIC, one message per peer, as our transport books its own: both
then pay the link for the bytes they send across it.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from torch import Tensor

from ..backends.emulated import EmulatedNic


class _Posted:
    """A collective already posted (the proxy returns its tensor): nothing to wait for but the booking."""

    def wait(self) -> None:
        pass


def _ranks(group: Any) -> list[int]:
    return dist.get_process_group_ranks(group) if isinstance(group, dist.ProcessGroup) else \
        dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(group))


class BookedCollectives:
    """torch's functional collectives, each one's inter-machine bytes booked on `nic` (every other name: torch's)."""

    def __init__(self, real: Any, nic: EmulatedNic):
        self.real, self.nic = real, nic

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def _book(self, ranks: Sequence[int], sent: Sequence[int], received: Sequence[int]) -> None:
        remote = [self.nic.remote(r) for r in ranks]
        self.nic.delayed(_Posted(), [n for n, far in zip(sent, remote) if far and n],
                         [n for n, far in zip(received, remote) if far and n]).wait()

    def all_to_all_single(self, x: Tensor, output_split_sizes: list[int] | None,
                          input_split_sizes: list[int] | None, group: Any, *args: Any, **kwargs: Any) -> Tensor:
        out = self.real.all_to_all_single(x, output_split_sizes, input_split_sizes, group, *args, **kwargs)
        ranks = _ranks(group)
        row = x[0].numel() * x.element_size() if x.dim() else x.element_size()
        pieces = lambda splits: [n * row for n in splits] if splits is not None else \
            [x.numel() * x.element_size() // len(ranks)] * len(ranks)  # noqa: E731
        self._book(ranks, pieces(input_split_sizes), pieces(output_split_sizes))
        return out

    def all_gather_tensor(self, x: Tensor, gather_dim: int, group: Any, *args: Any, **kwargs: Any) -> Tensor:
        out = self.real.all_gather_tensor(x, gather_dim, group, *args, **kwargs)
        ranks = _ranks(group)
        nbytes = [x.numel() * x.element_size()] * len(ranks)
        self._book(ranks, nbytes, nbytes)
        return out


@contextmanager
def over_emulated_link(nic: EmulatedNic) -> Iterator[BookedCollectives]:
    """diffusers' context-parallel collectives booked on `nic` while inside."""
    from diffusers.models import attention_dispatch

    real = attention_dispatch.funcol
    booked = BookedCollectives(real, nic)
    attention_dispatch.funcol = booked
    try:
        yield booked
    finally:
        attention_dispatch.funcol = real


__all__ = ["BookedCollectives", "over_emulated_link"]
