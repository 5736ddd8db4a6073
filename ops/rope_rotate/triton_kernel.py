"""Triton rope_rotate: rope and the KV Hadamard rotations of every head of a step in one
kernel (was: six rope kernels, two rotation casts and two GEMMs a layer).

Program (row t, block of BH heads, block of BN output columns): rope heads load x and its
rope partner and rotate in fp32; then, where a rotation is given, multiply by its columns.
A rotation must be c * S with c = rot[0, 0] > 0 and S in {-1, 0, 1} (kv_rotation's block
Hadamards are), so the product runs on tensor cores exactly: S is exact in bf16, x is split
into three bf16 parts (hi + lo + lo2 == x in fp32), the three dots accumulate in fp32, then
times c.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcompile.ops.cast import TL_DTYPES, round_to
from kvcompile.ops.launching import interpreting, launchable
from kvcompile.ops.pdl import launch as pdl_launch, wait_for_producers

HEADS_PER_PROGRAM = 16     # the smallest tensor-core tile height


@triton.jit
def _load(rows, hm, cols, D, R, cos_row, sin_row, ROPE: tl.constexpr, NEOX: tl.constexpr):
    """x[h, cols] of the head rows `rows` as fp32, roped (ROPE) with its partner columns."""
    x = tl.load(rows + cols[None, :], mask=hm[:, None] & (cols < D)[None, :], other=0.0)
    x = x.to(tl.float32)
    if ROPE:
        if NEOX:
            partner = tl.where(cols < R // 2, cols + R // 2, cols - R // 2)
        else:
            partner = cols ^ 1
        roped = cols < R
        partner = tl.where(roped, partner, cols)
        xp = tl.load(rows + partner[None, :], mask=hm[:, None] & (cols < D)[None, :], other=0.0)
        c = tl.load(cos_row + cols, mask=roped, other=1.0)
        s = tl.load(sin_row + cols, mask=roped, other=0.0)
        # columns past R pass through as they are (x * 1 + x * 0 would turn inf into nan)
        x = tl.where(roped[None, :], x * c[None, :] + xp.to(tl.float32) * s[None, :], x)
    return x


@triton.jit
def _heads(rows, out, h, hm, cols, D, R, cos_row, sin_row, rot, ROPE: tl.constexpr,
           NEOX: tl.constexpr, HAS_ROT: tl.constexpr, BLOCK_D: tl.constexpr,
           DTYPE: tl.constexpr, EXACT: tl.constexpr):
    """Output columns `cols` of heads h: (roped) x, times rot's columns `cols` if HAS_ROT
    (which reads the heads' whole rows)."""
    if HAS_ROT:
        d = tl.arange(0, BLOCK_D)
        x = _load(rows, hm, d, D, R, cos_row, sin_row, ROPE, NEOX)
        hi = x.to(tl.bfloat16)
        rest = x - hi.to(tl.float32)
        lo = rest.to(tl.bfloat16)
        lo2 = (rest - lo.to(tl.float32)).to(tl.bfloat16)
        r = tl.load(rot + d[:, None] * D + cols[None, :],
                    mask=(d[:, None] < D) & (cols[None, :] < D), other=0.0)
        sign = tl.where(r > 0, 1.0, tl.where(r < 0, -1.0, 0.0))
        if EXACT:
            sign = sign.to(tl.bfloat16)
            y = tl.dot(hi, sign)
            y = tl.dot(lo, sign, y)
            y = tl.dot(lo2, sign, y)
        else:   # the interpreter's bf16 dot is wrong: the same parts, upcast
            y = tl.dot(hi.to(tl.float32), sign)
            y = tl.dot(lo.to(tl.float32), sign, y)
            y = tl.dot(lo2.to(tl.float32), sign, y)
        y = y * tl.load(rot)
    else:
        y = _load(rows, hm, cols, D, R, cos_row, sin_row, ROPE, NEOX)
    tl.store(out + h[:, None] * D + cols[None, :], round_to(y, DTYPE, EXACT),
             mask=hm[:, None] & (cols[None, :] < D))


@triton.jit
def _rope_rotate(x_ptr, out_ptr, cos_ptr, sin_ptr, rot_a, rot_b, stride_xt, stride_xh,
                 stride_ct, n_heads, n_rope, blocks_a, D, R, NEOX: tl.constexpr,
                 HAS_A: tl.constexpr, HAS_B: tl.constexpr, BLOCK_D: tl.constexpr,
                 BH: tl.constexpr, BN: tl.constexpr, DTYPE: tl.constexpr,
                 EXACT: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    cols = tl.program_id(2) * BN + tl.arange(0, BN)
    x_row = x_ptr + t * stride_xt
    out = out_ptr + t * n_heads * D
    cos_row, sin_row = cos_ptr + t * stride_ct, sin_ptr + t * stride_ct
    if b < blocks_a:
        h = b * BH + tl.arange(0, BH)
        _heads(x_row + h[:, None] * stride_xh, out, h, h < n_rope, cols, D, R, cos_row,
               sin_row, rot_a, True, NEOX, HAS_A, BLOCK_D, DTYPE, EXACT)
    else:
        h = n_rope + (b - blocks_a) * BH + tl.arange(0, BH)
        _heads(x_row + h[:, None] * stride_xh, out, h, h < n_heads, cols, D, R, cos_row,
               sin_row, rot_b, False, NEOX, HAS_B, BLOCK_D, DTYPE, EXACT)


def rope_rotate_triton(x, cos, sin, neox: bool, n_rope: int, rot_a, rot_b) -> torch.Tensor:
    """Launch (arguments checked by the op): a new contiguous [T, H, D] in x's dtype."""
    n_rows, n_heads, head_dim = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    out = torch.empty((n_rows, n_heads, head_dim), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    bh = HEADS_PER_PROGRAM
    blocks_a = triton.cdiv(n_rope, bh)
    block_d = max(16, triton.next_power_of_2(head_dim))
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    rot_a = None if rot_a is None else rot_a.float().contiguous()
    rot_b = None if rot_b is None else rot_b.float().contiguous()
    bn = max(16, block_d // 4)      # four programs a head block: more SMs on a decode step
    grid = (n_rows, blocks_a + triton.cdiv(n_heads - n_rope, bh), block_d // bn)
    launchable(_rope_rotate)[grid](
        x, out, cos, sin, x if rot_a is None else rot_a, x if rot_b is None else rot_b,
        x.stride(0), x.stride(1), cos.stride(0), n_heads, n_rope, blocks_a, head_dim,
        cos.shape[-1], NEOX=bool(neox), HAS_A=rot_a is not None, HAS_B=rot_b is not None,
        BLOCK_D=block_d, BH=bh, BN=bn, DTYPE=TL_DTYPES[x.dtype],
        EXACT=not interpreting(), num_warps=4, **pdl_launch(x.device))
    return out
