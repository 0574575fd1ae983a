"""What users stack on a pipeline besides the parallelism, as `streamfusion generate` and `serve` take it: one
of diffusers' caches (caches.py; the ranks' skip decisions agreed in skips.py), LoRAs (lora.py) and torchao
weight-only quantization (quantize.py), parsed and checked from the command line in spec.py (light: no diffusers
import), applied in the order they compose by apply.py (`apply_stack`)."""
