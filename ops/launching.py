"""How every kvcompile Triton kernel is launched: through wrap_triton (torch.compile then
sees the kernel), or as it is under the Triton interpreter (TRITON_INTERPRET=1, the CPU
tests). No imports from the ops themselves: ops/pdl.py and each op's launcher use it."""
from __future__ import annotations

import os

import torch
from triton.runtime.jit import JITFunction


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def launchable(kernel):
    """wrap_triton so torch.compile sees the kernel; interpreted kernels go as they are."""
    if isinstance(kernel, JITFunction):
        return torch.library.wrap_triton(kernel)
    return kernel
