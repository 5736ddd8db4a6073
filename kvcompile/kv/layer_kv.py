"""What one attention layer reads and writes through the ops: its K and V page pools (uint8
[pages, page_bytes] in a kv_format page format, strided views of the store's page pairs),
its page table (int32, logical page -> physical page), the types, the rotations quantized
K / V rows are stored with (rotation.py) and the decode kernels' scratch. Plus the range
checks of positions against a store's capacity.
"""
from __future__ import annotations

import torch
from torch import nn

from kvcompile.errors import ContextLengthError
from kvcompile.kv.rotation import V_BLOCK, diagonal_blocks


class LayerKv(nn.Module):
    """What one attention layer needs to write and read its KV through the ops. A module
    (as in gpt-fast) so torch.compile treats the format ints as constants even with
    dynamic=True, and the pools / page table as buffers."""

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
                 k_type: int, v_type: int, page_size: int, k_rot: torch.Tensor | None = None,
                 v_rot: torch.Tensor | None = None, workspace: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("k_pool", k_pool)          # uint8 [num_pages, k page bytes]
        self.register_buffer("v_pool", v_pool)          # uint8 [num_pages, v page bytes]
        self.register_buffer("page_table", page_table)  # int32 [num_logical_pages]
        self.register_buffer("k_rot", k_rot)            # [D, D] for Q and K, or None
        self.register_buffer("v_rot", v_rot)            # [D, D] for V and the output, or None
        # the output's rotation as span_attention takes it: v_rot's diagonal blocks
        self.register_buffer("v_rot_blocks", None if v_rot is None
                             else diagonal_blocks(v_rot.float(), V_BLOCK))
        self.register_buffer("workspace", workspace)    # decode scratch (fp32), or None (CPU)
        self.k_type, self.v_type, self.page_size = k_type, v_type, page_size  # ggml ids


def decode_workspace_numel(config, sms: int) -> int:
    """fp32 elements of the decode scratch for DECODE_MAX_ROWS query rows on `sms` SMs."""
    from kvcompile.ops.span_attention.op import DECODE_MAX_ROWS
    from kvcompile.ops.span_attention.workspace import decode_workspace_floats
    group = config.n_heads // config.n_kv_heads
    return decode_workspace_floats(config.n_kv_heads, config.head_dim, DECODE_MAX_ROWS * group,
                                   sms)


def check_positions(positions: torch.Tensor, capacity: int) -> tuple[int, int]:
    """(min, max) of positions after checking they fit: one host read (a sync on CUDA), so
    eager only; raises ContextLengthError otherwise."""
    n = positions.numel()
    if n == 0:
        raise ContextLengthError("nothing to evaluate: pass at least one token")
    if n == 1:
        lo = hi = int(positions.reshape(()))
    else:
        lo, hi = torch.stack((positions.min(), positions.max())).tolist()
    check_range(lo, hi, capacity)
    return lo, hi


def check_range(lo: int, hi: int, capacity: int) -> None:
    if lo < 0 or hi >= capacity:
        raise ContextLengthError(
            f"position {hi if hi >= capacity else lo} is outside the KV cache of {capacity} "
            f"tokens; raise the context size (--ctx-size) or shorten the prompt / max tokens")
