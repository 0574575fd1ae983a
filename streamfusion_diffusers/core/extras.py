"""Optional dependencies: which extra of this package installs a missing module, said in one line."""
from __future__ import annotations

EXTRAS = {  # top-level module -> the extra that installs it (pyproject.toml's optional-dependencies)
    "diffusers": "diffusers", "transformers": "diffusers", "accelerate": "diffusers", "PIL": "diffusers",
    "imageio": "diffusers", "imageio_ffmpeg": "diffusers", "fastapi": "serve", "uvicorn": "serve",
    "starlette": "serve",
    "xfuser": "xdit", "distvae": "xdit", "yunchang": "bench", "matplotlib": "bench",
    "nvshmem": "nvshmem", "cuda": "nvshmem", "triton": "triton", "pytest": "test",
    "torchao": "quantize", "peft": "lora",
}


def install_hint(extra: str) -> str:
    """The command that installs an extra (this package is installed from its folder, not from an index)."""
    return f'pip install -e ".[{extra}]" in the streamfusion-diffusers folder'


def missing(module: str | None) -> str | None:
    """'needs <module>: pip install ...' for a module that an extra installs, else None."""
    top = (module or "").split(".")[0]
    return f"needs {top}: {install_hint(EXTRAS[top])}" if top in EXTRAS else None
