"""The kv_write / span_attention CPU references against a dense fp64 attention.

The expected K/V values come from an independent source: the gguf package's quantizers for
q8_0 / q4_0, plain dtype casts for f16 / bf16. Inputs are fresh random tensors (the seed is
printed so a failure can be replayed).
"""
from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

import kvcompile.ops  # noqa: F401
from kvcompile.errors import KvLayoutError
from kvcompile.ops import kv_format as F

TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0"]
GGUF_TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}


def fresh_generator() -> torch.Generator:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def stored_values(rows: torch.Tensor, name: str) -> torch.Tensor:
    """What a cache of type `name` holds for fp32 rows [..., D], as float64 (oracle side)."""
    if name in GGUF_TYPES:
        flat = rows.reshape(-1, rows.shape[-1]).numpy()
        deq = gguf.quants.dequantize(gguf.quants.quantize(flat, GGUF_TYPES[name]), GGUF_TYPES[name])
        return torch.from_numpy(np.asarray(deq, dtype=np.float64)).reshape(rows.shape)
    dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[name]
    return rows.to(dtype).double()


def dense_attention(q, k, v, q_pos, scale, window=0):
    """fp64, one (row, head) at a time: q [T, Hq, D], k/v [S, Hkv, D] -> [T, Hq, D]; with a
    window, each row over its last `window` keys."""
    n_rows, n_q, _ = q.shape
    group = n_q // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for t in range(n_rows):
        n = int(q_pos[t]) + 1
        a = max(0, n - window) if window else 0
        for h in range(n_q):
            keys, vals = k[a:n, h // group], v[a:n, h // group]
            p = torch.softmax(keys @ q[t, h].double() * scale, dim=0)
            out[t, h] = p @ vals
    return out


def make_pools(n_pages, k_name, v_name, page_size, n_kv, head_dim):
    kt, vt = F.kv_type(k_name), F.kv_type(v_name)
    return (torch.zeros(n_pages, F.page_bytes(kt, page_size, n_kv, head_dim), dtype=torch.uint8),
            torch.zeros(n_pages, F.page_bytes(vt, page_size, n_kv, head_dim), dtype=torch.uint8))


def write_in_chunks(k_pool, v_pool, k, v, table, kt, vt, page_size, cuts):
    """Write rows [0, S) the way a generation does: a prefill chunk, then smaller steps."""
    pos = torch.arange(k.shape[0])
    slots = table[pos // page_size].long() * page_size + pos % page_size
    for a, b in zip([0, *cuts], [*cuts, k.shape[0]]):
        torch.ops.kvcompile.kv_write(k_pool, v_pool, k[a:b], v[a:b], slots[a:b],
                                     kt.ggml_id, vt.ggml_id, page_size)


@pytest.mark.parametrize("k_name", TYPES)
@pytest.mark.parametrize("v_name", TYPES)
def test_span_attention_matches_dense_fp64(k_name, v_name):
    g = fresh_generator()
    kt, vt = F.kv_type(k_name), F.kv_type(v_name)
    page_size, n_q, n_kv, head_dim, n_ctx = 16, 6, 2, 64, 75    # 75: last page partly full
    n_pages = 8                                                  # more pages than needed
    k = torch.randn(n_ctx, n_kv, head_dim, generator=g) * 1.5
    v = torch.randn(n_ctx, n_kv, head_dim, generator=g)
    q = torch.randn(5, n_q, head_dim, generator=g)
    q_pos = torch.tensor([n_ctx - 1, 3, 40, n_ctx - 2, 16], dtype=torch.int32)
    table = torch.randperm(n_pages, generator=g).to(torch.int32)  # logical -> physical
    print(f"K {k_name} V {v_name} page table {table.tolist()}")

    k_pool, v_pool = make_pools(n_pages, k_name, v_name, page_size, n_kv, head_dim)
    write_in_chunks(k_pool, v_pool, k, v, table, kt, vt, page_size, cuts=[50, 51, 52, 60])

    # the pages hold exactly what the independent quantizer produces, at the mapped places
    for pool, rows, t, name, role in ((k_pool, k, kt, k_name, "k"), (v_pool, v, vt, v_name, "v")):
        pages = F.decode_pages(pool[table.long()], t, n_kv, page_size, head_dim, role=role)
        held = pages.permute(0, 2, 1, 3).reshape(-1, n_kv, head_dim)[:n_ctx].double()
        assert torch.equal(held, stored_values(rows, name)), f"{name} pages differ from gguf"

    scale = head_dim ** -0.5
    out = torch.ops.kvcompile.span_attention(q, k_pool, v_pool, table, q_pos, kt.ggml_id,
                                             vt.ggml_id, page_size, scale)
    ref = dense_attention(q, stored_values(k, k_name), stored_values(v, v_name), q_pos, scale)
    err = (out.double() - ref).abs().max().item()
    print(f"K {k_name} V {v_name}: max |out - fp64 dense| = {err:.3e}")
    assert out.shape == q.shape and out.dtype == q.dtype
    assert err < 2e-5


@pytest.mark.parametrize("k_name,v_name", [("f32", "f32"), ("q8_0", "q4_0"), ("bf16", "f16")])
def test_real_page_size_gqa_and_placement_independence(k_name, v_name):
    """Page size 256, SmolLM2's 9 query / 3 KV heads, 300 keys (two pages, one partly full):
    a permuted page table gives bitwise the same result as identity placement."""
    g = fresh_generator()
    kt, vt = F.kv_type(k_name), F.kv_type(v_name)
    page_size, n_q, n_kv, head_dim, n_ctx, n_pages = 256, 9, 3, 64, 300, 4
    k = torch.randn(n_ctx, n_kv, head_dim, generator=g)
    v = torch.randn(n_ctx, n_kv, head_dim, generator=g)
    q = torch.randn(4, n_q, head_dim, generator=g) * 2
    q_pos = torch.tensor([296, 297, 298, 299], dtype=torch.int32)   # a verify batch
    scale = head_dim ** -0.5
    outs = []
    for table in (torch.arange(n_pages, dtype=torch.int32), torch.tensor([3, 0, 2, 1], dtype=torch.int32)):
        k_pool, v_pool = make_pools(n_pages, k_name, v_name, page_size, n_kv, head_dim)
        write_in_chunks(k_pool, v_pool, k, v, table, kt, vt, page_size, cuts=[296, 297, 298, 299])
        outs.append(torch.ops.kvcompile.span_attention(q, k_pool, v_pool, table, q_pos,
                                                       kt.ggml_id, vt.ggml_id, page_size, scale))
    ref = dense_attention(q, stored_values(k, k_name), stored_values(v, v_name), q_pos, scale)
    err = (outs[0].double() - ref).abs().max().item()
    print(f"K {k_name} V {v_name} page 256: max |out - fp64 dense| = {err:.3e}")
    assert err < 2e-5
    assert torch.equal(outs[0], outs[1]), "a permuted page table changed the result"


@pytest.mark.parametrize("k_name,v_name", [("f32", "f16"), ("q8_0", "q4_0")])
@pytest.mark.parametrize("window", [1, 20, 100])
def test_span_attention_window(k_name, v_name, window):
    """A sliding window: each row over its last `window` keys (window 100 > the context: all
    of them). The table entries of pages before every row's window name a page that is not
    the layer's (an old page a windowed layer dropped): never read, never checked."""
    g = fresh_generator()
    kt, vt = F.kv_type(k_name), F.kv_type(v_name)
    page_size, n_q, n_kv, head_dim, n_ctx, n_pages = 16, 4, 2, 64, 90, 8
    k = torch.randn(n_ctx, n_kv, head_dim, generator=g)
    v = torch.randn(n_ctx, n_kv, head_dim, generator=g)
    q = torch.randn(6, n_q, head_dim, generator=g)
    q_pos = torch.tensor([89, 70, 88, 75, 71, 86], dtype=torch.int32)
    table = torch.randperm(n_pages, generator=g).to(torch.int32)
    k_pool, v_pool = make_pools(n_pages + 1, k_name, v_name, page_size, n_kv, head_dim)
    write_in_chunks(k_pool, v_pool, k, v, table, kt, vt, page_size, cuts=[70])
    k_pool[n_pages].fill_(0xff)          # NaN in every float type, -1 codes with NaN scales
    v_pool[n_pages].fill_(0xff)
    stale = table.clone()
    stale[:max(70 - window + 1, 0) // page_size] = n_pages
    scale = head_dim ** -0.5
    out = torch.ops.kvcompile.span_attention(q, k_pool, v_pool, stale, q_pos, kt.ggml_id,
                                             vt.ggml_id, page_size, scale, window=window)
    ref = dense_attention(q, stored_values(k, k_name), stored_values(v, v_name), q_pos, scale,
                          window)
    err = (out.double() - ref).abs().max().item()
    print(f"K {k_name} V {v_name} window {window}: max |out - fp64 dense| = {err:.3e}")
    assert err < 2e-5
    if window < 90:    # the window changes the result
        full = dense_attention(q, stored_values(k, k_name), stored_values(v, v_name), q_pos,
                               scale)
        assert (full - ref).abs().max() > 1e-3
    with pytest.raises(KvLayoutError, match="window must be 0"):
        torch.ops.kvcompile.span_attention(q, k_pool, v_pool, table, q_pos, kt.ggml_id,
                                           vt.ggml_id, page_size, scale, window=-1)
