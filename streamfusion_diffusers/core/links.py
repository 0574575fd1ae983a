"""Interconnect presets: per-GPU bandwidth and latency of the links a transfer can take (cost model, emulation)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A link as one GPU sees it: bandwidth in GB/s (1e9 bytes per second) one way, and per-message latency."""

    name: str
    gb_per_s: float
    latency_us: float

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        return nbytes / (self.gb_per_s * 1e9) + messages * self.latency_us * 1e-6


# inter-machine links, per GPU: a NIC's rate shared by the GPUs behind it
PRESETS = {
    "dgx": Link("DGX H100, 400 Gb/s InfiniBand per GPU", 400 / 8, 5.0),
    "p4de": Link("AWS p4de, 4 x 100 Gb/s EFA per 8 GPUs", 4 * 100 / 8 / 8, 20.0),
    "p5": Link("AWS p5, 3200 Gb/s EFA per 8 GPUs", 3200 / 8 / 8, 15.0),
}
# inside one machine: what NCCL's all-to-all carries per rank over NVSwitch, a starting point only (no record
# holds it): the calibration (`streamfusion tune`) fits the cost model to measured layouts around it
NVLINK = Link("NVLink/NVSwitch", 290.0, 10.0)


def parse_link(spec: str) -> Link:
    """A preset name, or 'GBPS:LATENCY_US' (e.g. '25:10') for any bandwidth/latency pair."""
    if spec in PRESETS:
        return PRESETS[spec]
    try:
        bandwidth, latency = (float(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"link {spec!r} is neither a preset ({', '.join(PRESETS)}) nor 'GBPS:LATENCY_US'") from None
    if bandwidth <= 0 or latency < 0:
        raise ValueError(f"link {spec!r}: bandwidth must be positive and latency non-negative")
    return Link(f"{bandwidth:g} GB/s, {latency:g} us", bandwidth, latency)
