"""Hadamard rotation of quantized KV (the idea of llama.cpp PR #21038, on by default there).

A few outlier channels make block quantization of K and V coarse. Rotating the head
vectors by an orthonormal Walsh-Hadamard matrix R (symmetric, R @ R = I) spreads outliers
over a block before quantizing, and changes nothing in exact arithmetic:
  (q R) . (k R) = q . k                      -> rotate Q and K when K is quantized
  sum_s p_s (v_s R) R = sum_s p_s v_s          -> rotate V, and the output back, when V is
The cache only ever holds rotated rows, so the ops and their kernels are unchanged.

Block sizes follow llama.cpp's so that both quantize the same numbers: for K the largest
power-of-two block (>= 64) that divides the head dim, for V blocks of 64.
"""
from __future__ import annotations

import torch

from kvcompile.ops.kv_format import KvType

MIN_BLOCK = 64


def hadamard(n: int) -> torch.Tensor:
    """Orthonormal Sylvester-Hadamard matrix [n, n], n a power of two: entry (i, j) is
    (-1)^popcount(i & j) / sqrt(n)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n ** 0.5).float()


def block_rotation(head_dim: int, block: int) -> torch.Tensor:
    return torch.block_diag(*[hadamard(block)] * (head_dim // block))


def k_rotation(t: KvType, head_dim: int) -> torch.Tensor | None:
    """The [D, D] rotation applied to Q and K before a K page of type t, or None."""
    if not t.quantized or head_dim % MIN_BLOCK:
        return None
    block = MIN_BLOCK
    while head_dim % (block * 2) == 0:
        block *= 2
    return block_rotation(head_dim, block)


V_BLOCK = MIN_BLOCK      # V rotations are block-diagonal with blocks of this size


def diagonal_blocks(rot: torch.Tensor, block: int) -> torch.Tensor:
    """The [D / block, block, block] diagonal blocks of a block-diagonal [D, D] rotation
    (span_attention's out_rot form: its decode reduce merges one block's columns a
    program)."""
    n = rot.shape[0] // block
    return torch.stack([rot[i * block:(i + 1) * block, i * block:(i + 1) * block]
                        for i in range(n)]).contiguous()


def v_rotation(t: KvType, head_dim: int) -> torch.Tensor | None:
    """The [D, D] rotation applied to V before a V page of type t (and to the attention
    output after), or None."""
    if not t.quantized or head_dim % MIN_BLOCK:
        return None
    return block_rotation(head_dim, V_BLOCK)
