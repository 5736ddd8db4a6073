"""Non-finite logits name their cause: the first weight tensor holding a NaN or an
infinity (a corrupt or badly converted file), or, with every weight finite, an overflow
in the compute dtype."""
from __future__ import annotations

import torch

from kvcompile.errors import ModelFileError
from kvcompile.models.layers import Embedding, Linear


def first_nonfinite_weight(model: torch.nn.Module) -> str | None:
    """The name of the first weight (in the model's order) with a non-finite value."""
    for name, module in model.named_modules():
        if isinstance(module, (Linear, Embedding)):
            q = module.quant_weight()
            if q is not None and not torch.isfinite(q.dequantize()).all():
                return f"{name}.weight" if name else "weight"
        for pname, p in module.named_parameters(recurse=False):
            if p is not None and p.is_floating_point() and not torch.isfinite(p).all():
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
