"""Probe kernel for benchmarks/exp/decode_layout_probe.py: decode split over q8_0 K (codes [H, P, D],
scales [H, NB, P]) and q4_0 / q8_0 V stored position-contiguous ([H, D/2 or D, P], scales [H, NB, P])."""
import triton
import triton.language as tl

from kvcompile.ops.span_attention.decode_kernel import LOG2E, _decode_reduce, decode_chunking  # noqa: F401
from kvcompile.ops.span_attention.quant_blocks import q4_codes_f16, q8_codes_f16


@triton.jit
def cvt_q8(c, ASM: tl.constexpr):
    return q8_codes_f16(c, not ASM)


@triton.jit
def cvt_q4(byte, ASM: tl.constexpr):
    return q4_codes_f16(byte, not ASM)


@triton.jit
def _split_t(q_ptr, k_codes, k_scl, v_codes, v_scl, page_table, q_pos_ptr,
             m_ptr, l_ptr, acc_ptr, stride_qt, stride_qh, n_rows, n_chunks,
             chunk_len, table_len, k_page_bytes, k_page_halves, k_scale_halves,
             v_page_bytes, v_page_halves, v_scale_halves, QK_SCALE: tl.constexpr,
             G: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, V4: tl.constexpr,
             ASM: tl.constexpr, SCALE_P: tl.constexpr):
    NB: tl.constexpr = D // 32
    DV: tl.constexpr = D // 2 if V4 else D          # code rows of a V tile
    c = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.arange(0, BLOCK_M)
    t = r // G
    row_ok = t < n_rows
    qp = tl.load(q_pos_ptr + t, mask=row_ok, other=-1)
    n_ctx = tl.minimum(tl.max(qp, 0) + 1, table_len * P)
    start = c * chunk_len
    end = tl.minimum(start + chunk_len, n_ctx)
    qrow = q_ptr + t.to(tl.int64) * stride_qt + (h * G + r % G) * stride_qh
    n = tl.arange(0, BLOCK_N)
    j = tl.arange(0, 32)
    dv = tl.arange(0, DV)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_a = tl.zeros([BLOCK_M, DV], tl.float32)
    acc_b = tl.zeros([BLOCK_M, DV], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        off = tl.multiple_of(n0 % P, BLOCK_N)
        pos = n0 + n
        live = pos < end
        phys = tl.load(page_table + n0 // P).to(tl.int64)
        kb = k_codes + phys * k_page_bytes + (h * P + off) * D
        ksb = k_scl + phys * k_page_halves + k_scale_halves + h * NB * P + off
        s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for b in tl.static_range(NB):
            sc = tl.load(ksb + b * P + n, mask=live, other=0.0).to(tl.float32)
            cb = tl.load(kb + n[None, :] * D + b * 32 + j[:, None])
            qb = tl.load(qrow[:, None] + b * 32 + j[None, :], mask=row_ok[:, None], other=0.0)
            s += tl.dot(qb, cvt_q8(cb, ASM)) * sc[None, :]
        s = s * QK_SCALE
        s = tl.where(pos[None, :] <= qp[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p16 = p.to(tl.float16)
        vb = v_codes + phys * v_page_bytes + h * DV * P + off
        vcode = tl.load(vb + dv[:, None] * P + n[None, :])            # [DV, N]
        vsb = v_scl + phys * v_page_halves + v_scale_halves + h * NB * P + off
        bi = tl.arange(0, NB)
        vs = tl.where(live[None, :], tl.load(vsb + bi[:, None] * P + n[None, :]), 0.0)
        if V4:
            vsx = tl.reshape(tl.broadcast_to(vs[:, None, :], (NB, 16, BLOCK_N)), (DV, BLOCK_N))
            lo, hi = cvt_q4(vcode, ASM)
            acc_a = tl.dot(p16, tl.trans(lo * vsx), acc_a * alpha[:, None])
            acc_b = tl.dot(p16, tl.trans(hi * vsx), acc_b * alpha[:, None])
        else:
            vsx = tl.reshape(tl.broadcast_to(vs[:, None, :], (NB, 32, BLOCK_N)), (DV, BLOCK_N))
            acc_a = tl.dot(p16, tl.trans(cvt_q8(vcode, ASM) * vsx), acc_a * alpha[:, None])
        m_i = m_new
    mrows = n_rows * G
    slot = (h * n_chunks + c) * mrows + r
    ok = (r < mrows) & (start < n_ctx)
    tl.store(m_ptr + slot, m_i, mask=ok)
    tl.store(l_ptr + slot, l_i, mask=ok)
    base = acc_ptr + slot.to(tl.int64)[:, None] * D
    if V4:
        col = (dv // 16) * 32 + dv % 16
        tl.store(base + col[None, :], acc_a, mask=ok[:, None])
        tl.store(base + (col + 16)[None, :], acc_b, mask=ok[:, None])
    else:
        tl.store(base + dv[None, :], acc_a, mask=ok[:, None])
