"""Debug switches: environment variables read once, when kvcompile.ops is imported, to
bisect a problem (the README lists them). Nothing else in the library reads the
environment: configuration is EngineConfig's.

- KVCOMPILE_PDL=0: decode kernels launch without programmatic dependent launch (ops/pdl.py).
- KVCOMPILE_CHECK_INDICES=1: the ops check their index values on CUDA too (a sync a call).
- KVCOMPILE_DECODE_IMPL=legacy|blocks|transposed: force one decode attention kernel.
- KVCOMPILE_DISABLE_PASSES=a,b: run the pass pipeline without these passes.
- KVCOMPILE_GDN=torch: Gated DeltaNet layers run the torch reference, not fla-core's kernels.
"""
from __future__ import annotations

import os


def _flag(name: str, default: bool) -> bool:
    return os.environ.get(name, "1" if default else "0") not in ("", "0")


PDL = _flag("KVCOMPILE_PDL", True)
CHECK_INDICES = _flag("KVCOMPILE_CHECK_INDICES", False)
DECODE_IMPL = os.environ.get("KVCOMPILE_DECODE_IMPL", "auto")
DISABLE_PASSES_ENV = "KVCOMPILE_DISABLE_PASSES"
DISABLE_PASSES = frozenset(n.strip() for n in os.environ.get(DISABLE_PASSES_ENV, "").split(",")
                           if n.strip())
GDN_TORCH = os.environ.get("KVCOMPILE_GDN", "") == "torch"
