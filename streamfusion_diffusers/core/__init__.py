"""The core: a layout bound to the running job (config, context, mesh, sequence lengths, link presets, logs).

With attention/ (the five methods as one schedule), kernels/ (attention with its log-sum-exp, merges) and
backends/ (transports) it is the lowest floor: it imports nothing above it. `method="auto"` is resolved by a
chooser the context is handed (the layout choice's, through streamfusion_diffusers.init_parallel).
"""
