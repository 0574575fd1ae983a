"""Benchmark support: workloads, link presets, the communication cost model."""
