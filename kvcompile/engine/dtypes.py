"""The model's compute dtype: named by the user, or picked for the device."""
from __future__ import annotations

import torch

from kvcompile.errors import KvcompileError
from kvcompile.ops.kv_format import FLOAT_DTYPES

DTYPES = {**FLOAT_DTYPES, "float32": torch.float32, "float16": torch.float16,
          "bfloat16": torch.bfloat16}
CHOICES = ("auto", "f32", "f16", "bf16")


class DtypeError(KvcompileError, ValueError):
    """The requested weight / activation dtype is not one kvcompile runs."""


def cpu_fast_path(spec: str | torch.dtype | None, device: torch.device | str) -> bool:
    """Whether an Engine on the CPU runs its fast path: None / "auto" on the CPU, where the
    C++ kernels build (ops/cpu_build.py). fp32 activations as the reference's, but the
    weights stay in their GGUF blocks (ops/qlinear/cpu_kernel.py) and the eager model calls
    the C++ kernels directly (ops/rows.py). dtype "f32" names the reference path:
    dequantized weights, the fp32 torch references.
    (A step traced by torch.compile with inductor's C++ lowering measured slower than this
    on SmolLM2-135M, and took 40 s and more to compile: docs/benchmarks.md.)"""
    if torch.device(device).type != "cpu" or not (spec is None or str(spec).lower() == "auto"):
        return False
    from kvcompile.ops.cpu_build import cpu_kernels_available
    return cpu_kernels_available()


def resolve_dtype(spec: str | torch.dtype | None, device: torch.device | str) -> torch.dtype:
    """None or "auto": bf16 on CUDA (f16 where the GPU has no bf16), f32 on the CPU (the
    fast path, or the reference path where it cannot run: see cpu_fast_path). Else f32 /
    f16 / bf16 by name or torch dtype."""
    if isinstance(spec, torch.dtype):
        if spec in DTYPES.values():
            return spec
        raise DtypeError(f"dtype {spec} is not supported; use one of {', '.join(CHOICES)}")
    if spec is None or str(spec).lower() == "auto":
        if torch.device(device).type != "cuda":
            return torch.float32
        ok = not torch.cuda.is_available() or torch.cuda.is_bf16_supported()
        return torch.bfloat16 if ok else torch.float16
    dtype = DTYPES.get(str(spec).lower())
    if dtype is None:
        raise DtypeError(f"unknown dtype {spec!r}; use one of {', '.join(CHOICES)}")
    return dtype
