"""What the attention kernels keep between calls, and who owns it.

Each ParallelContext owns one KernelState (created with it, emptied by `shutdown()`): an sp_attention call makes
its context's state the current one for the kernels it runs (`owned_by`), so two contexts in one process never
share a kernel choice, and after shutdown nothing a context made stays reachable from a module global.
"""
from __future__ import annotations

from collections.abc import Hashable
from contextvars import ContextVar
from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class KernelState:
    """The "auto" kernel choice's measurements and picks (dispatch.py, sdpa.py), and the host tables that captured CUDA
    graphs copy from at every replay (chunk_tables.py): they must live as long as the graphs."""

    times: dict[Hashable, dict[str, float]] = field(default_factory=dict)  # signature -> this rank's ms per kernel
    local: dict[Hashable, str] = field(default_factory=dict)  # signature -> this rank's pick outside a layer
    agreed: dict[Hashable, list[str | None]] = field(default_factory=dict)  # (ranks, layer signature) -> per call
    no_lse: dict[Hashable, str] = field(default_factory=dict)  # shapes -> fastest SDPA backend (sdpa.attention_sdpa)
    tables: list[Tensor] = field(default_factory=list)  # pinned chunk tables of captured kernel launches
    device_tables: dict[Hashable, Tensor] = field(default_factory=dict)  # eager chunk tables on the device

    def forget_choices(self) -> None:
        """Forget every time and choice (the captured tables stay: graphs may still replay them)."""
        self.times.clear()
        self.local.clear()
        self.agreed.clear()
        self.no_lse.clear()

    def clear(self) -> None:
        """Forget everything: the owner's graphs are gone with it."""
        self.forget_choices()
        self.tables.clear()
        self.device_tables.clear()


# Kernel calls made outside any sp_attention (kernel tests and benchmarks) belong to no context: the process owns
# their state, and no context ever reads or fills it.
_STANDALONE = KernelState()
# The state of the sp_attention call running in this thread (a ContextVar: set and reset around the call).
_current: ContextVar[KernelState | None] = ContextVar("streamfusion_kernel_state", default=None)


class owned_by:  # noqa: N801 - a context manager used as a function; a class: it runs at every layer call
    """Run the kernels inside with `state` as theirs."""

    __slots__ = ("state", "token")

    def __init__(self, state: KernelState):
        self.state = state

    def __enter__(self) -> None:
        self.token = _current.set(self.state)

    def __exit__(self, *exc: object) -> None:
        _current.reset(self.token)


def current() -> KernelState:
    """The state of the running sp_attention call's context, else the standalone calls' state."""
    state = _current.get()
    return _STANDALONE if state is None else state
