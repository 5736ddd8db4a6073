"""A weight matrix kept in its GGUF block format: planar rows (ops/qlinear/formats.py) on
the device, the type's name and the logical [out, in] shape. The loader makes them; the
models' Linear and Embedding take them (`set_quantized`) and multiply through the qlinear
op, so the weight is never dequantized into memory."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompile.ops.qlinear.formats import to_planar, weight_format


@dataclass
class QuantWeight:
    planar: torch.Tensor          # uint8 [rows, planar_row_bytes(cols)]
    type_name: str                # ggml type name, e.g. "IQ4_XS"
    shape: tuple[int, int]        # [out, in] = [rows, cols]

    @property
    def ggml_id(self) -> int:
        return weight_format(self.type_name).ggml_id

    @property
    def nbytes(self) -> int:
        return self.planar.numel()

    @property
    def device(self) -> torch.device:
        return self.planar.device

    def dim(self) -> int:
        return 2

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from kvcompile.ops.qlinear.naive import dequantize_planar
        return dequantize_planar(self.planar, self.type_name, self.shape[1]).to(dtype)

    @classmethod
    def from_gguf_rows(cls, raw: torch.Tensor, type_name: str, cols: int) -> "QuantWeight":
        """From a GGUF tensor's bytes as uint8 rows [rows, row_bytes(cols)]."""
        return cls(to_planar(raw, type_name, cols), weight_format(type_name).name,
                   (raw.shape[0], cols))


def cat_rows(weights: list[QuantWeight]) -> QuantWeight | None:
    """One weight whose rows are the given ones' (a fused projection), or None when their
    types or row lengths differ (then they stay separate)."""
    first = weights[0]
    if any(w.type_name != first.type_name or w.shape[1] != first.shape[1] for w in weights):
        return None
    planar = join_rows([w.planar for w in weights])
    return QuantWeight(planar, first.type_name, (planar.shape[0], first.shape[1]))


def join_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts) of 2-D row blocks, as a view when they already lie back to back in
    one storage (the loader places fused projections' parts so: weights.layout), else a
    copy."""
    first = parts[0]
    storage = first.untyped_storage()
    end = first.storage_offset()
    for t in parts:
        if not (t.is_contiguous() and t.dtype == first.dtype and t.shape[1:] == first.shape[1:]
                and t.untyped_storage().data_ptr() == storage.data_ptr()
                and t.storage_offset() == end):
            return torch.cat(parts)
        end += t.numel()
    rows = sum(t.shape[0] for t in parts)
    view = torch.empty(0, dtype=first.dtype, device=first.device)
    return view.set_(storage, first.storage_offset(), (rows, *first.shape[1:]))
