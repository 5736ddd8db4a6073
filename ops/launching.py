"""How every kvcompile Triton kernel is launched: through wrap_triton (torch.compile then
sees the kernel), or as it is under the Triton interpreter (TRITON_INTERPRET=1, the CPU
tests). No imports from the ops themselves: ops/pdl.py and each op's launcher use it.

A launch is *traced* while wrap_triton is on: torch.compile tracing it, or a launcher called
outside its op (benchmarks; torch's kernel wrapper then launches it eagerly); triton_op turns
it off inside an op's CUDA implementation, which is what eager, graph-lowered and captured
steps run. PDL goes only with untraced launches (ops/pdl.py); a register cap (`maxnreg`)
with any launch that torch.compile is not tracing (its inductor lowering takes no launch
options beyond num_warps / num_stages).
"""
from __future__ import annotations

import os

import torch
from triton.runtime.jit import JITFunction

try:
    from torch._library.triton import is_wrap_triton_enabled
except ImportError:           # no wrap_triton at all: nothing traces a launch
    def is_wrap_triton_enabled() -> bool:
        return False


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def launchable(kernel):
    """wrap_triton so torch.compile sees the kernel; interpreted kernels go as they are."""
    if isinstance(kernel, JITFunction):
        return torch.library.wrap_triton(kernel)
    return kernel


def traced() -> bool:
    """Whether a launch now goes through wrap_triton's tracing (module docstring)."""
    return is_wrap_triton_enabled()


def register_cap(maxnreg: int | None) -> dict:
    """`maxnreg` as a launch option where one can go: not while torch.compile traces the
    launch, not in the interpreter."""
    on = maxnreg and not interpreting() and not torch.compiler.is_compiling()
    return {"maxnreg": maxnreg} if on else {}
