"""What `parallelize` and the stack take: a pipeline or a bare transformer, and the transformers it runs.

Its own module, below both: parallel_pipeline.py imports the stack's skips, so the stack cannot import it back.
"""
from __future__ import annotations

from typing import Any

import torch


def transformers_of(target: Any) -> list[torch.nn.Module]:
    """Every transformer the target runs: a pipeline's (Wan 2.2 A14B's two experts), or the bare one."""
    first = target.transformer if hasattr(target, "transformer") else target
    second = getattr(target, "transformer_2", None)
    return [first, *([second] if second is not None else [])]
