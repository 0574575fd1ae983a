"""The commands (`streamfusion generate | verify | launch | plan`) and what they and the benchmarks use:
spawning local ranks, phase and layer timing. The top floor, under bench/ (the `bench` and `tune` commands,
which time the others' jobs) and the dispatcher above both (streamfusion_diffusers/cli.py).
"""
