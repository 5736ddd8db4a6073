"""fp32 torch reference of kv_write (also the CPU implementation)."""
from __future__ import annotations

import torch

from kvcompile.ops import kv_format as F


def kv_write_naive(k_pool: torch.Tensor, v_pool: torch.Tensor, k_new: torch.Tensor,
                   v_new: torch.Tensor, slots: torch.Tensor, k_type: int, v_type: int,
                   page_size: int) -> None:
    for pool, rows, t, role in ((k_pool, k_new, F.kv_type(k_type), "k"),
                                (v_pool, v_new, F.kv_type(v_type), "v")):
        n_heads, head_dim = rows.shape[1], rows.shape[2]
        vals, scales = F.split_pages(pool, t, n_heads, page_size, head_dim, role=role)
        page = (slots // page_size).long()
        off = (slots % page_size).long()
        enc, enc_scales = F.encode_rows(rows, t)          # [T, H, D'] and [T, H, D/32]
        heads = torch.arange(n_heads, device=rows.device)
        vals[page[:, None], heads[None, :], off[:, None]] = enc
        if scales is not None:
            # split_pages returns the scales as a copy (byte views of an offset slice may be
            # misaligned for fp16), so write them back through the byte view.
            scales[page[:, None], heads[None, :], off[:, None]] = enc_scales
            code_bytes = pool.shape[1] - scales[0].numel() * 2
            # Write back only the touched pages: other pages may be filled concurrently
            # (streaming copies into ring slots of the same pool).
            touched = torch.unique(page)
            pool[touched, code_bytes:] = F.scale_bytes(scales[touched], t, role)
