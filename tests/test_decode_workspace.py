"""The decode kernels' caller-provided workspace: carving, sizing, errors, and results
identical to per-call scratch (interpreter on the CPU; the GPU test also checks that a
decode with a workspace allocates nothing)."""
from __future__ import annotations

import random

import pytest
import torch

from kernel_oracle import dense_reference, fill_pools, fresh_seed, rel_err, run_interpreted
from kvcompile.errors import KvLayoutError
from kvcompile.ops import kv_format as F
from kvcompile.ops.span_attention.decode_split import decode_chunking
from kvcompile.ops.span_attention.workspace import carve, decode_workspace_floats

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_workspace_bound_covers_every_chunking():
    rng = random.Random(fresh_seed())
    for _ in range(2000):
        n_kv, sms, pps = rng.choice((1, 2, 4, 8, 32)), rng.randint(1, 200), rng.randint(1, 8)
        block_n, page = rng.choice((16, 32, 64)), rng.choice((64, 256))
        table_len = rng.randint(1, 4096)
        _, n_chunks = decode_chunking(table_len, page, n_kv, block_n, sms, pps)
        rows, d = rng.randint(1, 48), rng.choice((64, 128, 256))
        need = n_kv * n_chunks * rows * (d + 2)
        assert need <= decode_workspace_floats(n_kv, d, rows, sms, pps)


def test_every_launch_default_fits_the_cache_workspace():
    """A cache sizes its decode workspace for MAX_PROGRAMS_PER_SM programs an SM: no default
    launch config (decode_blocks.blocks_config, decode_kernel's programs an SM) asks for more."""
    from kvcompile.ops.span_attention.decode_blocks import blocks_config
    from kvcompile.ops.span_attention.decode_kernel import legacy_programs_per_sm
    from kvcompile.ops.span_attention.workspace import MAX_PROGRAMS_PER_SM
    for d in (64, 128, 256):
        assert max(legacy_programs_per_sm(d, q) for q in (True, False)) <= MAX_PROGRAMS_PER_SM
        for block_m in (16, 32, 64, 128):
            for quantized in (True, False):
                assert blocks_config(d, block_m, quantized)["programs_per_sm"] <= \
                    MAX_PROGRAMS_PER_SM, (d, block_m, quantized)


def test_carve_views_are_disjoint_and_errors_say_what_to_change():
    ws = torch.randn(1000)
    m, l, acc = carve(ws, 2, 3, 4, 16, "cpu")
    assert (m.shape, l.shape, acc.shape) == ((2, 3, 4), (2, 3, 4), (2, 3, 4, 16))
    ptrs = {t.data_ptr() for t in (m, l, acc)}
    assert len(ptrs) == 3 and acc.data_ptr() + acc.numel() * 4 <= ws.data_ptr() + 1000 * 4
    with pytest.raises(KvLayoutError, match="decode_workspace_floats"):
        carve(torch.empty(10), 2, 3, 4, 16, "cpu")
    with pytest.raises(KvLayoutError, match="fp32"):
        carve(torch.empty(1000, dtype=torch.float16), 2, 3, 4, 16, "cpu")
    assert carve(None, 2, 3, 4, 16, "cpu")[2].shape == (2, 3, 4, 16)


def _case(seed, rows=2, n_ctx=300, d=64, k_name="q8_0", v_name="q4_0"):
    gen = torch.Generator().manual_seed(seed)
    n_kv, g, page = 2, 3, 64
    n_pages = -(-n_ctx // page)
    table = torch.randperm(n_pages + 2, generator=gen)[:n_pages].int()
    k_rows = torch.randn(n_ctx, n_kv, d, generator=gen)
    v_rows = torch.randn(n_ctx, n_kv, d, generator=gen)
    kp, vp = fill_pools(k_rows, v_rows, table, k_name, v_name, page, n_pages + 2, gen)
    q = torch.randn(rows, n_kv * g, d, generator=gen).half()
    q_pos = torch.arange(n_ctx - rows, n_ctx, dtype=torch.int32)
    args = dict(q=q, k_pool=kp, v_pool=vp, page_table=table, q_pos=q_pos,
                k_type=F.kv_type(k_name).ggml_id, v_type=F.kv_type(v_name).ggml_id,
                page_size=page, scale=d ** -0.5)
    return args, n_kv, g


@pytest.mark.parametrize("impl", ["legacy", "blocks"])
def test_interpreted_decode_with_workspace_equals_per_call_scratch(impl):
    args, n_kv, g = _case(fresh_seed())
    rows, d = args["q"].shape[0], args["q"].shape[2]
    ws = torch.randn(decode_workspace_floats(n_kv, d, rows * g, 8))   # garbage in it
    jobs = [{"kind": "decode", "args": args, "opts": {"impl": impl}},
            {"kind": "decode", "args": args, "opts": {"impl": impl, "workspace": ws}}]
    plain, with_ws = run_interpreted(jobs)
    assert torch.equal(plain["out"], with_ws["out"])
    ref = dense_reference(args["q"], args["k_pool"], args["v_pool"], args["page_table"],
                          args["q_pos"], "q8_0", "q4_0", args["page_size"], args["scale"])
    err = rel_err(with_ws["out"], ref)
    print(f"{impl}: max rel err {err:.2e}")
    assert err < 1e-3


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("pair", ["q8_0/q4_0", "bf16/bf16"])
def test_gpu_decode_op_with_workspace_is_identical_and_allocates_nothing(pair):
    k_name, v_name = pair.split("/")
    args, n_kv, g = _case(fresh_seed(), rows=4, n_ctx=5000, d=128, k_name=k_name, v_name=v_name)
    a = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    a["q"] = a["q"].bfloat16()
    from kvcompile.ops.span_attention.launch import num_sms
    ws = torch.randn(decode_workspace_floats(n_kv, 128, 8 * g, num_sms(a["q"].device)),
                     device="cuda")
    op = torch.ops.kvcompile.span_attention
    order = ("q", "k_pool", "v_pool", "page_table", "q_pos", "k_type", "v_type", "page_size",
             "scale")
    plain = op(*(a[k] for k in order))
    op(*(a[k] for k in order), ws)          # warm (Triton compiles and caches)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    outs = [op(*(a[k] for k in order), ws) for _ in range(3)]
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    out_bytes = sum(o.numel() * o.element_size() for o in outs)
    assert grown <= out_bytes, f"decode with a workspace allocated {grown - out_bytes} B"
    for o in outs:
        assert torch.equal(o, plain)
