"""Prometheus text for /metrics, kept by hand (no client library): requests by route and status, a latency
histogram, queue depth, the pipeline's phase times, peak GPU memory, group readiness and restarts."""
from __future__ import annotations

from collections import Counter
from typing import Any

BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 600.0)  # seconds
PREFIX = "streamfusion"


class Metrics:
    """Counters since start; `render` adds the live gauges the service passes."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()
        self.latency: dict[str, list[int]] = {}  # route -> per-bucket counts (+Inf last)
        self.latency_sum: Counter[str] = Counter()
        self.phases: Counter[str] = Counter()
        self.generations = 0
        self.dropped = 0  # clients gone before their request started
        self.cancelled = 0  # requests stopped while they ran (client gone, video deleted)
        self.restarts = 0
        self.peak_bytes = 0.0
        self.last_peak_bytes = 0.0
        self.run_s = 0.0  # an average of recent generation times: what Retry-After assumes
        self.build_s: float | None = None  # start of `serve` to ready

    def request(self, route: str, status: int, seconds: float) -> None:
        self.requests[(route, status)] += 1
        counts = self.latency.setdefault(route, [0] * (len(BUCKETS) + 1))
        counts[next((i for i, b in enumerate(BUCKETS) if seconds <= b), len(BUCKETS))] += 1
        self.latency_sum[route] += seconds

    def ran(self, records: list[dict[str, Any]], seconds: float) -> None:
        """A request's generations: their phases, peak memory (rank 0's), and the time it took."""
        for record in records:
            self.generations += 1
            self.phases.update(record["phases_s"])
            peak = (record.get("peak_memory_gib") or 0.0) * 2**30
            self.last_peak_bytes = peak
            self.peak_bytes = max(self.peak_bytes, peak)
        self.run_s = seconds if self.run_s == 0.0 else 0.8 * self.run_s + 0.2 * seconds

    def render(self, queue_depth: int, running: int, groups: dict[str, int]) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} {kind}"])
            lines.extend(f"{PREFIX}_{name}{labels} {value:g}" for labels, value in samples)

        metric("requests_total", "counter", "HTTP requests answered, by route and status",
               [(f'{{route="{r}",status="{s}"}}', n) for (r, s), n in sorted(self.requests.items())])
        samples = []
        for route, counts in sorted(self.latency.items()):
            total = 0
            for bound, count in zip((*BUCKETS, "+Inf"), counts):
                total += count
                samples.append((f'_bucket{{route="{route}",le="{bound}"}}', total))
            samples += [(f'_sum{{route="{route}"}}', self.latency_sum[route]), (f'_count{{route="{route}"}}', total)]
        metric("request_seconds", "histogram", "seconds from a request's arrival to its answer", samples)
        metric("queue_depth", "gauge", "requests waiting for a parallel group", [("", queue_depth)])
        metric("running", "gauge", "requests running on a parallel group", [("", running)])
        metric("dropped_total", "counter", "queued requests dropped because their client disconnected",
               [("", self.dropped)])
        metric("cancelled_total", "counter", "running requests cancelled (client disconnected, video deleted)",
               [("", self.cancelled)])
        metric("generations_total", "counter", "pipeline calls (an image or a video each)", [("", self.generations)])
        metric("phase_seconds_total", "counter", "seconds per pipeline phase, summed over generations (rank 0)",
               [(f'{{phase="{p}"}}', s) for p, s in sorted(self.phases.items())])
        metric("gpu_memory_peak_bytes", "gauge", "highest peak GPU memory of any generation (rank 0; 0 on the CPU)",
               [("", self.peak_bytes)])
        metric("gpu_memory_last_peak_bytes", "gauge", "peak GPU memory of the last generation (rank 0)",
               [("", self.last_peak_bytes)])
        metric("groups", "gauge", "parallel groups by state", [(f'{{state="{s}"}}', n) for s, n in sorted(groups.items())])
        metric("restarts_total", "counter", "parallel groups restarted after a rank failed", [("", self.restarts)])
        if self.build_s is not None:
            metric("ready_seconds", "gauge", "seconds from start to ready (ranks started, pipeline built, warm)",
                   [("", self.build_s)])
        return "\n".join(lines) + "\n"


__all__ = ["Metrics"]
