"""The core: the layout of a job (config, mesh and process groups, joining the job, sequence lengths, link
presets, the transports a job may name and what each can do, logs, the error measure).

With kernels/ (attention with its log-sum-exp, merges) and backends/ (transports) above it, then context.py (the
ParallelContext that composes them) and attention/ (the five methods as one schedule), it is the lowest floor:
it imports nothing above it. `method="auto"` is resolved by a chooser the context is handed (the layout choice's,
through streamfusion_diffusers.init_parallel).
"""
