"""Does cuDNN attention with LSE lose on our [B, L, H, D] views? One GPU, the Ulysses U2 shapes of a Flux 4096
layer (66,048 tokens, 12 heads, D 128) and of CogVideoX 49 frames (17,776 + 226 tokens, 24 heads, D 64):
the strided view (what the schedules pass today), contiguous [B, H, L, D] (with and without the copy),
cuDNN and flash without LSE, and F.scaled_dot_product_attention's default choice without LSE (yunchang's
TORCH_CUDNN, which our bench's xDiT runs at R = 1, is cuDNN without LSE). Interleaved CUDA-event medians."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from streamfusion_diffusers.commands.timing import interleaved_ms
from streamfusion_diffusers.kernels.sdpa import _call

dev = torch.device("cuda")
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29511", rank=0, world_size=1)  # timing syncs ranks
for name, L, H, D in [("flux4096-U2", 66_048, 12, 128), ("flux2048-U2", 16_896, 12, 128),
                      ("cog49-U2", 18_002, 24, 64)]:
    q, k, v = (torch.randn(1, L, H, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    qc, kc, vc = (x.contiguous() for x in (qt, kt, vt))
    s = D ** -0.5
    calls = {
        "cudnn+lse strided": lambda: _call("cudnn", qt, kt, vt, s),
        "cudnn+lse contiguous": lambda: _call("cudnn", qc, kc, vc, s),
        "copy + cudnn+lse contiguous": lambda: _call("cudnn", *(x.transpose(1, 2).contiguous() for x in (q, k, v)), s),
        "flash+lse strided": lambda: _call("flash", qt, kt, vt, s),
        "cudnn no lse strided": lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
            qt, kt, vt, None, False, 0.0, False, False, scale=s)[0],
        "flash no lse strided": lambda: torch.ops.aten._scaled_dot_product_flash_attention(
            qt, kt, vt, 0.0, False, False, scale=s)[0],
        "F.sdpa strided (no lse)": lambda: F.scaled_dot_product_attention(qt, kt, vt),
        "F.sdpa contiguous (no lse)": lambda: F.scaled_dot_product_attention(qc, kc, vc),
    }
    ref = _call("cudnn", qc, kc, vc, s)[0].float()
    stats = interleaved_ms(list(calls.values()), 20, 3, dev)
    base = stats[0].median
    for (label, call), st in zip(calls.items(), stats):
        err = (call()[0] if "+lse" in label else call()).float().sub(ref).abs().max().item()
        print(f"{name:12s} {label:28s} {st.median:8.3f} ms  x{st.median / base:5.2f}  err {err:.1e}")
