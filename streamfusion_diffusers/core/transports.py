"""The transports a job may name (`ParallelConfig.backend`, `--backend`): each one's aliases and capabilities.

One table, at the lowest floor, so that the config check, the CLI's choices, the layout choice and the attention
schedules ask it instead of matching names; the factory that builds each one is backends/__init__.py's.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransportSpec:
    """What the rest of the package may know of a transport without building it.

    name: what a config names it by. aliases: other names it answers to; an alias that is one of its
    process_groups also pins the process group's backend (context.py refuses a job that runs another).
    process_groups: the torch.distributed backends it runs over ("nccl": GPUs, "gloo": the CPU); on others the
    factory falls back to the torch transport. overlap: attention/overlap.py's pipelined Ulysses may run over it
    (two-sided all-to-alls that the caller's GEMMs can run beside). comm_dtype: a config's comm_dtype may wrap it
    (backends/quantized.py sends its chunks as one byte per value). timed_as: the transport whose recipe timings
    stand for it (the cost model does not tell its all-to-all apart from that one's). summary: --backend's help.
    """

    name: str
    summary: str
    aliases: tuple[str, ...] = ()
    process_groups: tuple[str, ...] = ("nccl", "gloo")
    overlap: bool = True
    comm_dtype: bool = True
    timed_as: str = ""  # "": its own name

    def __post_init__(self) -> None:
        if not self.timed_as:
            object.__setattr__(self, "timed_as", self.name)


TRANSPORTS: dict[str, TransportSpec] = {}


def register_transport(spec: TransportSpec) -> TransportSpec:
    """Add a transport to the table (backends.register_builder then says how to build it)."""
    taken = {n for s in TRANSPORTS.values() for n in (s.name, *s.aliases)} & {spec.name, *spec.aliases}
    if taken:
        raise ValueError(f"transport {spec.name!r}: the name(s) {', '.join(sorted(taken))} are taken; pick others")
    TRANSPORTS[spec.name] = spec
    return spec


def find_transport(name: str) -> TransportSpec | None:
    """The transport a name or alias stands for, None if none does."""
    return next((s for s in TRANSPORTS.values() if name == s.name or name in s.aliases), None)


def transport_spec(name: str) -> TransportSpec:
    """The transport a name or alias stands for; an unknown name is one line naming the known ones."""
    spec = find_transport(name)
    if spec is None:
        raise ValueError(f"backend {name!r} is not one of {', '.join(transport_names(aliases=True))}")
    return spec


def transport_names(aliases: bool = False) -> tuple[str, ...]:
    """Every transport's name (with aliases: every name a config takes)."""
    return tuple(n for s in TRANSPORTS.values() for n in ((s.name, *s.aliases) if aliases else (s.name,)))


register_transport(TransportSpec("torch", "torch.distributed's NCCL on GPUs, gloo on the CPU",
                                 aliases=("nccl", "gloo")))
register_transport(TransportSpec("symm-pull", "torch with Ulysses' even all-to-alls as peer loads from symmetric "
                                 "memory (GPUs)", process_groups=("nccl",), timed_as="torch"))
register_transport(TransportSpec("nvshmem", "one-sided puts into NVSHMEM symmetric memory (GPUs)",
                                 process_groups=("nccl",), overlap=False, comm_dtype=False))
