"""The one place C++ CPU kernels are built: through inductor's C++ code cache (the compiler
and flags torch.compile's C++ backend uses for this machine, the ISA it picked, the built
library cached on disk across processes), so the CPU kernels need nothing that
torch.compile on the CPU does not need already.

A kernel source defines `extern "C" void kernel(...)`; `cpu_kernel(source, argtypes)`
returns a Python callable taking tensors for pointer arguments and ints / floats for the
others, or raises CpuKernelError (no C++ compiler, no OpenMP, a torch without inductor):
callers fall back to the fp32 reference.
"""
from __future__ import annotations

import functools
import sys
import threading

from kvcompile.errors import KvcompileError

BUILD_NOTICE_S = 1.0      # a build slower than this (not a cache hit) says what it is doing


class CpuKernelError(KvcompileError, RuntimeError):
    """A C++ CPU kernel could not be built on this machine."""


# Whether this machine builds and runs the kernels at all (one tiny build, cached): a
# machine without a compiler is told once, not once per kernel.
_PROBE = 'extern "C" void kernel(float* x) { x[0] += 1.0f; }'


@functools.cache
def cpu_kernel(source: str, argtypes: tuple[str, ...]):
    """The built `kernel` of `source` (argtypes: its C parameter types, e.g. "const float*",
    "int64_t", "float"). Built once a process; on disk once a machine."""
    notice = threading.Timer(BUILD_NOTICE_S, _tell_building)
    notice.daemon = True
    notice.start()
    try:
        from torch._inductor.codecache import CppPythonBindingsCodeCache
        return CppPythonBindingsCodeCache.load_pybinding(list(argtypes), source)
    except Exception as e:      # a compiler error, a missing toolchain, an older torch
        raise CpuKernelError(f"the C++ CPU kernels could not be built ({type(e).__name__}: "
                             f"{str(e)[:300]}); install a C++ compiler with OpenMP (g++) for "
                             f"the fast CPU path, or pass dtype='f32' for the reference "
                             f"path") from None
    finally:
        notice.cancel()


_told = threading.Event()


def _tell_building() -> None:
    """Once a process, while a kernel builds (a first run on this machine: a few seconds
    each, then cached on disk)."""
    if not _told.is_set():
        _told.set()
        print("kvcompile: building the C++ CPU kernels for this machine (first run only; "
              "cached on disk) ...", file=sys.stderr, flush=True)


@functools.cache
def cpu_kernels_available() -> bool:
    """Whether C++ kernels build here (a probe kernel, built and run once); where they do
    not, one warning says why (the CPU then runs its fp32 reference path)."""
    import warnings

    import torch
    try:
        x = torch.zeros(1)
        cpu_kernel(_PROBE, ("float*",))(x)
        return float(x[0]) == 1.0
    except CpuKernelError as e:
        warnings.warn(f"{e}; the CPU runs its fp32 reference path, several times slower",
                      RuntimeWarning, stacklevel=2)
        return False
