"""Triton kv_write: quantize-on-write of new K/V rows into their pages (one launch, K and V).

Program (row t, KV head h) reads D values of K and of V and stores them at slot[t] in the
page layout of kv_format. q8_0 / q4_0 give exactly the ggml / gguf codes and scales:
the divisions are correctly rounded (div_rn) and, on the GPU, x * (1/d) is a separately
rounded multiply (mul.rn: never contracted into an fma with the following add).
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from kvcompile.ops import kv_format as F
from kvcompile.ops.cast import to_bf16 as _to_bf16
from kvcompile.ops.launching import interpreting, launchable
from kvcompile.ops.pdl import launch as pdl_launch, wait_for_producers
from kvcompile.ops.span_attention.launch import page_geometry


@triton.jit
def _mul_rn(a, b, EXACT_MUL: tl.constexpr):
    if EXACT_MUL:
        return libdevice.mul_rn(a, tl.broadcast_to(b, a.shape))
    return a * b  # interpreter: numpy rounds every operation on its own


@triton.jit
def _store_row(pool, page_off, head, off, src, d_lo, d_hi, code_bytes, P: tl.constexpr,
               D: tl.constexpr, KV_TYPE: tl.constexpr, POS_MAJOR: tl.constexpr,
               EXACT_MUL: tl.constexpr):
    """Write one row (D values as two [D/32, 16] halves of each block) of KV head `head`
    at position `off` of the page starting at byte `page_off`. POS_MAJOR (quantized V):
    codes [H, cols, P] and scales [H, D/32, P] (kv_format), else row-major [H, P, *]."""
    base = pool + page_off
    row = head * P + off
    lo = tl.load(src + d_lo).to(tl.float32)
    hi = tl.load(src + d_hi).to(tl.float32)
    if KV_TYPE == 0:
        tl.store((base + (row * D + d_lo) * 4).to(tl.pointer_type(tl.float32)), lo)
        tl.store((base + (row * D + d_hi) * 4).to(tl.pointer_type(tl.float32)), hi)
    elif KV_TYPE == 1:
        tl.store((base + (row * D + d_lo) * 2).to(tl.pointer_type(tl.float16)), lo.to(tl.float16))
        tl.store((base + (row * D + d_hi) * 2).to(tl.pointer_type(tl.float16)), hi.to(tl.float16))
    elif KV_TYPE == 30:
        tl.store((base + (row * D + d_lo) * 2).to(tl.pointer_type(tl.bfloat16)),
                 _to_bf16(lo, EXACT_MUL))
        tl.store((base + (row * D + d_hi) * 2).to(tl.pointer_type(tl.bfloat16)),
                 _to_bf16(hi, EXACT_MUL))
    elif KV_TYPE == 8:
        amax = tl.maximum(tl.max(tl.abs(lo), 1), tl.max(tl.abs(hi), 1))
        dsc = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
        inv = tl.where(dsc == 0, 0.0, tl.math.div_rn(tl.full(dsc.shape, 1.0, tl.float32), dsc))
        ylo = _mul_rn(lo, inv[:, None], EXACT_MUL)
        yhi = _mul_rn(hi, inv[:, None], EXACT_MUL)
        rlo = tl.floor(tl.abs(ylo) + 0.5)      # roundf: half away from zero
        rhi = tl.floor(tl.abs(yhi) + 0.5)
        qlo = tl.where(ylo < 0, -rlo, rlo).to(tl.int8)
        qhi = tl.where(yhi < 0, -rhi, rhi).to(tl.int8)
        if POS_MAJOR:
            lo_at = (head * D + d_lo) * P + off
            hi_at = (head * D + d_hi) * P + off
        else:
            lo_at = row * D + d_lo
            hi_at = row * D + d_hi
        tl.store((base + lo_at).to(tl.pointer_type(tl.int8)), qlo)
        tl.store((base + hi_at).to(tl.pointer_type(tl.int8)), qhi)
        _store_scales(base + code_bytes, head, off, dsc, P, D, POS_MAJOR)
    else:  # q4_0
        alo = tl.abs(lo)
        ahi = tl.abs(hi)
        mlo = tl.max(alo, 1)
        mhi = tl.max(ahi, 1)
        j = tl.arange(0, 16)
        # first value of largest magnitude (ggml scans 0..31 with a strict '<')
        ilo = tl.argmax(alo, 1, tie_break_left=True)
        ihi = tl.argmax(ahi, 1, tie_break_left=True)
        vlo = tl.sum(tl.where(j[None, :] == ilo[:, None], lo, 0.0), 1)
        vhi = tl.sum(tl.where(j[None, :] == ihi[:, None], hi, 0.0), 1)
        mx = tl.where(mlo >= mhi, vlo, vhi)
        dsc = mx * -0.125                       # == mx / -8 exactly
        inv = tl.where(dsc == 0, 0.0, tl.math.div_rn(tl.full(dsc.shape, 1.0, tl.float32), dsc))
        zlo = _mul_rn(lo, inv[:, None], EXACT_MUL) + 8.5
        zhi = _mul_rn(hi, inv[:, None], EXACT_MUL) + 8.5
        clo = tl.minimum(zlo.to(tl.int32), 15)  # z > 0: truncation == ggml's (int8_t) cast
        chi = tl.minimum(zhi.to(tl.int32), 15)
        packed = (clo | (chi << 4)).to(tl.uint8)
        col = tl.arange(0, D // 32)[:, None] * 16 + j[None, :]      # byte of the row
        if POS_MAJOR:
            tl.store(base + (head * (D // 2) + col) * P + off, packed)
        else:
            tl.store(base + row * (D // 2) + col, packed)
        _store_scales(base + code_bytes, head, off, dsc, P, D, POS_MAJOR)


@triton.jit
def _store_scales(scales, head, off, dsc, P: tl.constexpr, D: tl.constexpr,
                  POS_MAJOR: tl.constexpr):
    """The row's D/32 fp16 scales: [H, P, D/32] or, position-major, [H, D/32, P]."""
    blk = tl.arange(0, D // 32)
    if POS_MAJOR:
        at = (head * (D // 32) + blk) * P + off
    else:
        at = (head * P + off) * (D // 32) + blk
    tl.store((scales + at * 2).to(tl.pointer_type(tl.float16)), dsc.to(tl.float16))


@triton.jit
def _kv_write(k_pool, v_pool, k_new, v_new, slots, page_table, stride_kt, stride_kh,
              stride_vt, stride_vh, k_page_stride, v_page_stride, k_code_bytes, v_code_bytes,
              P: tl.constexpr, D: tl.constexpr, K_TYPE: tl.constexpr, V_TYPE: tl.constexpr,
              HAS_TABLE: tl.constexpr, EXACT_MUL: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots + t).to(tl.int64)      # with a page table: the logical position
    off = slot % P
    if HAS_TABLE:
        page = tl.load(page_table + slot // P).to(tl.int64)
    else:
        page = slot // P
    blk = tl.arange(0, D // 32)
    j = tl.arange(0, 16)
    d_lo = blk[:, None] * 32 + j[None, :]   # values 0..15 of each block
    d_hi = d_lo + 16                         # values 16..31
    t64 = t.to(tl.int64)
    _store_row(k_pool, page * k_page_stride, h, off, k_new + t64 * stride_kt + h * stride_kh,
               d_lo, d_hi, k_code_bytes, P, D, K_TYPE, False, EXACT_MUL)
    v_pos_major: tl.constexpr = V_TYPE == 2 or V_TYPE == 8    # quantized V (kv_format)
    _store_row(v_pool, page * v_page_stride, h, off, v_new + t64 * stride_vt + h * stride_vh,
               d_lo, d_hi, v_code_bytes, P, D, V_TYPE, v_pos_major, EXACT_MUL)


def kv_write_triton(k_pool, v_pool, k_new, v_new, slots, k_type, v_type, page_size,
                    page_table=None):
    """Launch the kernel (arguments already validated by check_kv_write_args)."""
    assert F.dense_pages(k_pool) and F.dense_pages(v_pool), "KV pools need dense page rows"
    assert k_new.stride(2) == 1 and v_new.stride(2) == 1, "rows need a dense last dim"
    assert slots.is_contiguous(), "slots must be contiguous"
    assert page_table is None or page_table.is_contiguous(), "page_table must be contiguous"
    n_rows, n_heads, head_dim = k_new.shape
    kg = page_geometry(k_pool, k_type, page_size, head_dim)
    vg = page_geometry(v_pool, v_type, page_size, head_dim)
    if n_rows == 0:
        return
    launchable(_kv_write)[(n_rows, n_heads)](
        k_pool, v_pool, k_new, v_new, slots, slots if page_table is None else page_table,
        k_new.stride(0), k_new.stride(1),
        v_new.stride(0), v_new.stride(1), k_pool.stride(0), v_pool.stride(0),
        kg.code_bytes, vg.code_bytes, P=page_size, D=head_dim, K_TYPE=kg.kv_type,
        V_TYPE=vg.kv_type, HAS_TABLE=page_table is not None, EXACT_MUL=not interpreting(),
        num_warps=1, **pdl_launch(k_new.device))
