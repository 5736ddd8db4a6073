"""Paged KV cache: per attention layer a K and a V page pool plus a page table.

Pools are uint8 [num_pages, page_bytes] in one of the kv_format page formats. The page
table (int32, logical page -> physical page) is identity when the cache is made, but the
model always reads it, so pages can be placed anywhere (later: resident pages + ring
slots). Only the layers listed in `layers` get KV (hybrid models have recurrent layers).
Quantized K / V rows are stored Hadamard-rotated (kv_rotation; `rotate=False` turns it off).
"""
from __future__ import annotations

import torch
from torch import nn

from kvcompile.config import ModelConfig
from kvcompile.errors import ContextLengthError, KvLayoutError
from kvcompile.kv_rotation import V_BLOCK, diagonal_blocks, k_rotation, v_rotation
from kvcompile.ops import kv_format as F


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


def decode_workspace(device: torch.device, config) -> torch.Tensor | None:
    """The decode kernels' scratch for the widest verify (DECODE_MAX_ROWS rows) on CUDA, so
    decode allocates nothing per step; None on the CPU (the reference needs none)."""
    if device.type != "cuda":
        return None
    from kvcompile.ops.span_attention.launch import num_sms
    return torch.empty(decode_workspace_numel(config, num_sms(device)), dtype=torch.float32,
                       device=device)


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


class PagedKvCache:
    streams = False     # every page on the device: forwards need no bracket

    def __init__(self, config: ModelConfig, max_tokens: int, k_type="f32", v_type="f32",
                 page_size: int = 256, device="cpu", layers=None, rotate: bool = True):
        if max_tokens <= 0:
            raise ContextLengthError(f"the KV cache needs room for at least one token; "
                                     f"got max_tokens={max_tokens}")
        if page_size <= 0:
            raise KvLayoutError(f"page size must be positive, got {page_size}")
        self.config = config
        self.k_type, self.v_type = F.kv_type(k_type), F.kv_type(v_type)
        self.page_size = page_size
        self.num_pages = -(-max_tokens // page_size)
        self.capacity = self.num_pages * page_size
        self.device = torch.device(device)
        if layers is None:   # every attention layer (all of them, except in hybrid models)
            layers = [i for i in range(config.n_layers) if config.is_attention_layer(i)]
        self.layers = tuple(sorted(set(layers)))
        bad = [i for i in self.layers if not 0 <= i < config.n_layers]
        if bad:
            raise KvLayoutError(f"KV layers {bad} are outside the model's {config.n_layers} layers")
        h, d = config.n_kv_heads, config.head_dim
        k_bytes = F.page_bytes(self.k_type, page_size, h, d)
        v_bytes = F.page_bytes(self.v_type, page_size, h, d)
        identity = torch.arange(self.num_pages, dtype=torch.int32, device=self.device)
        k_rot = k_rotation(self.k_type, d) if rotate else None
        v_rot = v_rotation(self.v_type, d) if rotate else None
        workspace = decode_workspace(self.device, config)   # one, shared: layers run in turn
        self._kv = {
            i: LayerKv(torch.zeros(self.num_pages, k_bytes, dtype=torch.uint8, device=self.device),
                       torch.zeros(self.num_pages, v_bytes, dtype=torch.uint8, device=self.device),
                       identity.clone(), self.k_type.ggml_id, self.v_type.ggml_id, page_size,
                       None if k_rot is None else k_rot.to(self.device),
                       None if v_rot is None else v_rot.to(self.device), workspace)
            for i in self.layers}

    def layer(self, i: int) -> LayerKv:
        return self._kv[i]

    def has_layer(self, i: int) -> bool:
        return i in self._kv

    @property
    def nbytes(self) -> int:
        return sum(kv.k_pool.nbytes + kv.v_pool.nbytes for kv in self._kv.values())

    def set_page_table(self, table: torch.Tensor, layer: int | None = None) -> None:
        """Place logical pages at other physical pages (for one layer, or all). Must be a
        permutation of the pool's pages; the pages' contents are not moved."""
        table = torch.as_tensor(table, dtype=torch.int32).to(self.device)
        if table.shape != (self.num_pages,) or not torch.equal(
                table.sort().values.cpu(), torch.arange(self.num_pages, dtype=torch.int32)):
            raise KvLayoutError(f"a page table must be a permutation of 0..{self.num_pages - 1}")
        for i in (self.layers if layer is None else (layer,)):
            self._kv[i].page_table.copy_(table)

    def check_positions(self, positions: torch.Tensor) -> tuple[int, int]:
        return check_positions(positions, self.capacity)

    def reset(self) -> None:
        """Start a new sequence: identity page tables again. The pools are not cleared (that
        would cost a pass over the whole cache): attention only reads positions 0..q_pos,
        which the new sequence writes before it reads them."""
        for kv in self._kv.values():
            kv.page_table.copy_(torch.arange(self.num_pages, dtype=torch.int32))
