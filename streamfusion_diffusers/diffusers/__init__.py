"""The diffusers integration: `parallelize` / `unparallelize` (plans, split and gather hooks in sharding.py),
the attention processors, the CFG split, CUDA graphs and compile of a parallelized transformer, the VAE decode
over the ranks (vae/). Above the core and the layout choice, below the
commands.
"""
