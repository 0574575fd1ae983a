"""/metrics through prometheus_client: requests by route and status, a latency histogram, queue depth, the
pipeline's phase times, peak GPU memory, group readiness and restarts, calls that waited for a compile.

Only the front process reports (the ranks hand their records back to it with each answer), so one registry of
this process is all there is: prometheus_client's multiprocess mode is not needed. The registry is the server's
own, not the library's global one, so two servers in one process (tests) keep apart.
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 600.0)  # seconds
PREFIX = "streamfusion"
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """Counters since start; `render` sets the live gauges from what the service passes, then writes the text."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.run_s = 0.0  # an average of recent generation times: what Retry-After assumes
        self.build_s: float | None = None  # start of `serve` to ready
        self.peak_bytes = 0.0
        self._requests = Counter(f"{PREFIX}_requests", "HTTP requests answered, by route and status",
                                 ["route", "status"], registry=registry)
        self._latency = Histogram(f"{PREFIX}_request_seconds", "seconds from a request's arrival to its answer",
                                  ["route"], buckets=BUCKETS, registry=registry)
        self._queue = Gauge(f"{PREFIX}_queue_depth", "requests waiting for a parallel group", registry=registry)
        self._running = Gauge(f"{PREFIX}_running", "requests running on a parallel group", registry=registry)
        self._dropped = Counter(f"{PREFIX}_dropped", "queued requests dropped because their client disconnected",
                                registry=registry)
        self._cancelled = Counter(f"{PREFIX}_cancelled", "running requests cancelled (client disconnected, video "
                                  "deleted)", registry=registry)
        self._generations = Counter(f"{PREFIX}_generations", "pipeline calls (an image or a video each)",
                                    registry=registry)
        self._phases = Counter(f"{PREFIX}_phase_seconds", "seconds per pipeline phase, summed over generations "
                               "(rank 0)", ["phase"], registry=registry)
        self._peak = Gauge(f"{PREFIX}_gpu_memory_peak_bytes", "highest peak GPU memory of any generation (rank 0; "
                           "0 on the CPU)", registry=registry)
        self._last_peak = Gauge(f"{PREFIX}_gpu_memory_last_peak_bytes", "peak GPU memory of the last generation "
                                "(rank 0)", registry=registry)
        self._groups = Gauge(f"{PREFIX}_groups", "parallel groups by state", ["state"], registry=registry)
        self._restarts = Counter(f"{PREFIX}_restarts", "parallel groups restarted after a rank failed",
                                 registry=registry)
        self._stalls = Counter(f"{PREFIX}_compile_stalls", "pipeline calls that compiled the blocks before they ran "
                               "(a size or batch the warm-up did not make), by size", ["size"], registry=registry)
        self._stall_s = Counter(f"{PREFIX}_compile_stall_seconds", "seconds those calls spent compiling, by size",
                                ["size"], registry=registry)
        self._ready = Gauge(f"{PREFIX}_ready_seconds", "seconds from start to ready (ranks started, pipeline built, "
                            "warm)", registry=registry)

    def request(self, route: str, status: int, seconds: float) -> None:
        self._requests.labels(route, str(status)).inc()
        self._latency.labels(route).observe(seconds)

    def dropped(self) -> None:
        self._dropped.inc()

    def cancelled(self) -> None:
        self._cancelled.inc()

    def restarted(self) -> None:
        self._restarts.inc()

    def compile_stall(self, size: str, seconds: float) -> None:
        self._stalls.labels(size).inc()
        self._stall_s.labels(size).inc(seconds)

    def ran(self, records: list[dict[str, Any]], seconds: float) -> None:
        """A request's generations: their phases, peak memory (rank 0's), and the time it took."""
        for record in records:
            self._generations.inc()
            for phase, spent in record["phases_s"].items():
                self._phases.labels(phase).inc(spent)
            peak = (record.get("peak_memory_gib") or 0.0) * 2**30
            self._last_peak.set(peak)
            self.peak_bytes = max(self.peak_bytes, peak)
            self._peak.set(self.peak_bytes)
        self.run_s = seconds if self.run_s == 0.0 else 0.8 * self.run_s + 0.2 * seconds

    def render(self, queue_depth: int, running: int, groups: dict[str, int]) -> bytes:
        self._queue.set(queue_depth)
        self._running.set(running)
        for state, count in groups.items():
            self._groups.labels(state).set(count)
        if self.build_s is not None:
            self._ready.set(self.build_s)
        return generate_latest(self.registry)


__all__ = ["CONTENT_TYPE", "Metrics"]
