"""Dequantize one GGUF tensor's stored bytes to float32 with the `gguf` package.

kvcompile has no dequantization code of its own for weights: `gguf.quants.dequantize`
is the reference for every ggml type it implements. The few plain types it leaves out
(F64 and the integer types) are cast here; anything else is reported by tensor and type.
"""
from __future__ import annotations

import gguf
import numpy as np

from kvcompile.errors import UnsupportedModelError

# Stored as typed numpy arrays by the reader, so a cast is the whole dequantization.
_PLAIN_TYPES = {"F32", "F16", "F64", "I8", "I16", "I32", "I64"}


def dequantizable_types() -> list[str]:
    """ggml type names that `dequantize_tensor` can read with this gguf package."""
    traits = getattr(gguf.quants, "_type_traits", {})
    names = set(_PLAIN_TYPES) | {t.name for t in traits}
    return sorted(names)


def check_dequantizable(name: str, type_name: str) -> None:
    """Fail before any work when a tensor's type cannot be read."""
    if type_name not in dequantizable_types():
        raise _unsupported(name, type_name)


def _unsupported(name: str, type_name: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"tensor {name!r} is stored as {type_name}, which kvcompile cannot dequantize "
        f"(readable types: {', '.join(dequantizable_types())}); re-quantize the model "
        f"to one of those, e.g. Q8_0 or Q4_K_M")


def dequantize_tensor(name: str, data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """data: the reader's array for the tensor -> float32 array in PyTorch order."""
    if qtype.name in _PLAIN_TYPES:
        return np.array(data, dtype=np.float32)  # a copy: never hand out the read-only mmap
    try:
        out = gguf.quants.dequantize(data, qtype)
    except NotImplementedError:
        raise _unsupported(name, qtype.name) from None
    return np.asarray(out, dtype=np.float32)
