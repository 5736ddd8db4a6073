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
import hashlib
import os
import sys

from kvcompile.errors import KvcompileError

class CpuKernelError(KvcompileError, RuntimeError):
    """A C++ CPU kernel could not be built on this machine."""


# Whether this machine builds and runs the kernels at all (one tiny build, cached): a
# machine without a compiler is told once, not once per kernel.
_PROBE = 'extern "C" void kernel(float* x) { x[0] += 1.0f; }'


@functools.cache
def cpu_kernel(source: str, argtypes: tuple[str, ...]):
    """The built `kernel` of `source` (argtypes: its C parameter types, e.g. "const float*",
    "int64_t", "float"). Built once a process; on disk once a machine."""
    try:
        import torch
        from torch._inductor.codecache import CppPythonBindingsCodeCache
        marker = _built_marker(source, argtypes, torch.__version__)
        built = os.path.exists(marker)
        if not built:
            _tell_building()
        fn = CppPythonBindingsCodeCache.load_pybinding(list(argtypes), source)
    except Exception as e:      # a compiler error, a missing toolchain, an older torch
        raise CpuKernelError(f"the C++ CPU kernels could not be built ({type(e).__name__}: "
                             f"{str(e)[:300]}); install a C++ compiler with OpenMP (g++) for "
                             f"the fast CPU path, or pass dtype='f32' for the reference "
                             f"path") from None
    if not built:
        try:
            os.makedirs(os.path.dirname(marker), exist_ok=True)
            open(marker, "a").close()
        except OSError:
            pass                # an unwritable cache: the notice shows again, nothing else
    return fn


def _built_marker(source: str, argtypes, version: str) -> str:
    """A file beside inductor's cache that says this kernel was built on this machine (the
    cache itself is keyed by internals a cache hit cannot be asked about cheaply)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    key = hashlib.sha256(f"{version}\0{argtypes}\0{source}".encode()).hexdigest()[:24]
    return os.path.join(cache_dir(), "kvcompile_cpu_kernels", key)


_told = [False]


def _tell_building() -> None:
    """Once a process, before a kernel this machine has not built yet (a few seconds each,
    then cached on disk)."""
    if not _told[0]:
        _told[0] = True
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
