"""Non-finite logits name their cause: the first weight tensor holding a NaN or an
infinity (a corrupt or badly converted file), or, with every weight finite, an overflow
in the compute dtype."""
from __future__ import annotations

import torch

from kvcompile.errors import ModelFileError
from kvcompile.models.layers import Embedding, Linear
from kvcompile.models.quant_weight import QuantWeight


CHUNK_ELEMENTS = 1 << 24      # a weight is checked this many values at a time: the check
# runs after a failure, on a device that may have no room for a whole weight's copy


def _finite(t: torch.Tensor) -> bool:
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(c).all()) for c in flat.split(CHUNK_ELEMENTS))


def _quant_finite(q: QuantWeight) -> bool:
    rows = max(1, CHUNK_ELEMENTS // q.shape[1])
    return all(_finite(QuantWeight(q.planar[i:i + rows], q.type_name,
                                   (min(rows, q.shape[0] - i), q.shape[1])).dequantize())
               for i in range(0, q.shape[0], rows))


def first_nonfinite_weight(model: torch.nn.Module) -> str | None:
    """The name of the first weight (in the model's order) with a non-finite value."""
    for name, module in model.named_modules():
        if isinstance(module, (Linear, Embedding)):
            q = module.quant_weight()
            if q is not None and not _quant_finite(q):
                return f"{name}.weight" if name else "weight"
        for pname, p in module.named_parameters(recurse=False):
            if p is not None and p.is_floating_point() and not _finite(p):
                return f"{name}.{pname}" if name else pname
    return None


def check_finite(logits: torch.Tensor, model: torch.nn.Module, dtype: torch.dtype) -> None:
    if bool(torch.isfinite(logits).all()):
        return
    bad = first_nonfinite_weight(model)
    if bad is not None:
        raise ModelFileError(f"the model's logits are not finite: weight {bad} holds NaN or "
                             f"infinite values (a corrupt or badly converted file); "
                             f"re-download or re-convert the model")
    raise ModelFileError(f"the model's logits are not finite though every weight is: the "
                         f"activations overflow in {dtype}; try dtype='f32' (--dtype f32)")
