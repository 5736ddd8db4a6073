"""The CPU's fast path (issue 48) against the fp32 references: each C++ kernel on fresh random
inputs against its op's naive.py, and the default Engine against dtype='f32' on the default
model, teacher-forced. Speed is the benchmark's (benchmarks/bench_cpu_smollm2.py)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import kvcompile.ops  # noqa: F401
from kvcompile.ops import kv_format as F
from kvcompile.ops.cpu_build import cpu_kernels_available
from kvcompile.ops.kv_write.cpu_kernel import write_rows
from kvcompile.ops.kv_write.naive import kv_write_naive
from kvcompile.ops.kv_write.op import physical_slots
from kvcompile.ops.qlinear.cpu_kernel import CPU_FORMATS, dequantize_cpu, qlinear_rows
from kvcompile.ops.qlinear.formats import to_planar, weight_format
from kvcompile.ops.qlinear.naive import dequantize_planar
from kvcompile.ops.rms_norm.cpu_kernel import rms_norm_rows
from kvcompile.ops.rms_norm.naive import rms_norm_naive
from kvcompile.ops.rope_rotate.cpu_kernel import rope_rows
from kvcompile.ops.rope_rotate.naive import rope_rotate_naive
from kvcompile.ops.silu_mul.cpu_kernel import silu_mul_rows
from kvcompile.ops.silu_mul.naive import silu_mul_naive
from kvcompile.ops.span_attention.cpu_kernel import attention_rows
from kvcompile.ops.span_attention.naive import span_attention_naive

pytestmark = pytest.mark.skipif(not cpu_kernels_available(),
                                reason="no C++ compiler for the CPU kernels")


def planar(type_name: str, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """A random weight quantized by gguf-py (the oracle's quantizer), as planar rows."""
    w = (torch.randn(rows, cols, generator=gen) * 0.05).numpy()
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    return to_planar(torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8)).view(rows, -1),
                     type_name, cols)


@pytest.mark.parametrize("type_name", sorted(CPU_FORMATS))
def test_qlinear_kernel_against_the_reference(type_name):
    gen = torch.Generator().manual_seed(len(type_name) * 7 + CPU_FORMATS[type_name])
    n, k = 72, 96 + 32 * int(torch.randint(0, 4, (1,), generator=gen))
    w = planar(type_name, n, k, gen)
    ref = dequantize_planar(w, type_name, k)
    assert torch.equal(dequantize_cpu(w, type_name, k), ref)      # ggml's arithmetic, exactly
    qtype = weight_format(type_name).ggml_id
    x = torch.randn(12, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    for m in (1, 3, 8, 12):               # GEMV rows, and the dequantize + GEMM path
        got = qlinear_rows(x[:m], w, qtype, k, bias)
        torch.testing.assert_close(got, x[:m] @ ref.T + bias, rtol=1e-5, atol=1e-5)
    # a row's result does not depend on the rows beside it (verify step == one-row steps)
    eight = qlinear_rows(x[:8], w, qtype, k)
    for i in (0, 5, 7):
        assert torch.equal(eight[i:i + 1], qlinear_rows(x[i:i + 1], w, qtype, k))


def f32_pools(gen, n_pages=12, page=16, heads=3, dim=64, n=150):
    """f32 pools with n rows written at positions 0..n-1 through a shuffled page table."""
    kt = F.kv_type("f32")
    pools = [torch.zeros(n_pages, F.page_bytes(kt, page, heads, dim), dtype=torch.uint8)
             for _ in range(2)]
    table = torch.randperm(n_pages, generator=gen).to(torch.int32)
    k, v = torch.randn(2, n, heads, dim, generator=gen)
    pos = torch.arange(n, dtype=torch.int32)
    kv_write_naive(*pools, k, v, physical_slots(pos, table, page), kt.ggml_id, kt.ggml_id, page)
    return pools, table, (k, v, pos)


def test_kv_write_kernel_writes_what_the_reference_writes():
    gen = torch.Generator().manual_seed(3)
    (kp, vp), table, (k, v, pos) = f32_pools(gen)
    mine = [torch.zeros_like(kp), torch.zeros_like(vp)]
    order = torch.randperm(len(pos), generator=gen)     # rows in any order, a few at a time
    for rows in order.split(7):
        write_rows(*mine, k[rows], v[rows], pos[rows], table, 16)
    assert torch.equal(mine[0], kp) and torch.equal(mine[1], vp)


@pytest.mark.parametrize("window", [0, 5, 40])
def test_decode_attention_kernel_against_the_reference(window):
    gen = torch.Generator().manual_seed(11 + window)
    (kp, vp), table, (_, _, pos) = f32_pools(gen)
    f32 = F.kv_type("f32").ggml_id
    q = torch.randn(5, 9, 64, generator=gen)
    q_pos = torch.tensor([3, 77, 120, 148, 149], dtype=torch.int32)
    got = attention_rows(q, kp, vp, table, q_pos, 16, 0.125, window)
    for i in range(q.shape[0]):
        ref = span_attention_naive(q[i:i + 1], kp, vp, table, q_pos[i:i + 1], f32, f32, 16,
                                   0.125, window)
        torch.testing.assert_close(got[i:i + 1], ref, rtol=1e-5, atol=1e-6)
        one = attention_rows(q[i:i + 1], kp, vp, table, q_pos[i:i + 1], 16, 0.125, window)
        assert torch.equal(one, got[i:i + 1])


def test_row_kernels_against_the_references():
    gen = torch.Generator().manual_seed(5)
    x, res = torch.randn(2, 4, 576, generator=gen)
    w = torch.rand(576, generator=gen) + 0.5
    for got, ref in zip(rms_norm_rows(x, w, 1e-5, res), rms_norm_naive(x, w, 1e-5, res)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rms_norm_rows(x, w, 1e-5)[1], rms_norm_naive(x, w, 1e-5)[1],
                               rtol=1e-5, atol=1e-6)
    heads = torch.randn(4, 15, 64, generator=gen)
    ang = torch.rand(4, 32, generator=gen) * 6
    for neox in (False, True):
        cos, sin = ang.cos(), ang.sin()
        cos, sin = ((torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)) if neox else
                    (cos.repeat_interleave(2, -1), torch.stack([-sin, sin], -1).flatten(-2)))
        torch.testing.assert_close(rope_rows(heads, cos, sin, neox, 12),
                                   rope_rotate_naive(heads, cos, sin, neox, 12, None, None),
                                   rtol=1e-6, atol=1e-6)
    gu = torch.randn(3, 2 * 1536, generator=gen) * 4
    torch.testing.assert_close(silu_mul_rows(gu), silu_mul_naive(gu), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def engines():
    from kvcompile.engine.engine import Engine
    common = dict(ctx_size=512, cache_prompt=False, progress=False)
    return Engine(None, **common), Engine(None, dtype="f32", **common)


def test_the_default_cpu_engine_is_the_fast_path(engines):
    fast, ref = engines
    assert fast.cpu_fast and not ref.cpu_fast
    assert fast.model.blocks[0].mlp.down.qtype and not ref.model.blocks[0].mlp.down.qtype
    assert fast.model.blocks[0].attn.cpu_kernels and not ref.model.blocks[0].attn.cpu_kernels


@pytest.mark.parametrize("chunk", [8, 256])
def test_fast_path_matches_the_fp32_reference_teacher_forced(engines, chunk):
    """Decode-width steps (the GEMV and attention kernels) and prefill chunks: the weights
    are the reference's exactly, so only summation order differs."""
    from kvcompile.engine.evaluate import evaluate, summary
    fast, ref = engines
    gen = torch.Generator().manual_seed(chunk)
    text = " ".join(["lighthouse", "ledger", "ships", "night", "grandmother", "names", "sea",
                     "wind", "counted", "passed"][int(i)] for i in torch.randint(0, 10, (300,),
                                                                                 generator=gen))
    ids = fast.tokenizer.encode(text)[:160]
    s = summary(evaluate(fast, ids, chunk, reference=ref))
    assert s["top1"] >= 0.99 and s["kl"] <= 1e-4, s


def test_a_kernel_that_does_not_build_is_a_clear_error():
    from kvcompile.errors import KvcompileError
    from kvcompile.ops.cpu_build import CpuKernelError, cpu_kernel
    with pytest.raises(CpuKernelError, match="dtype='f32'") as e:
        cpu_kernel('extern "C" void kernel(float* x) { not C++ }', ("float*",))
    assert isinstance(e.value, KvcompileError)


@pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler")
def test_a_first_build_says_so_once(monkeypatch, capsys):
    """A kernel this machine has not built yet (a new source: a random constant) prints one
    line before it builds, once a process; the same kernel in a later process (its built
    marker on disk) prints nothing; the kernels work."""
    import random

    import kvcompile.ops.cpu_build as cb
    monkeypatch.setattr(cb, "_told", [False])
    sources = [f'extern "C" void kernel(float* x) {{ x[0] += {c}.0f; }}'
               for c in random.Random().sample(range(1, 10**6), 2)]   # exact in a float
    errs = []
    for src in sources:
        k = cb.cpu_kernel(src, ("float*",))
        x = torch.zeros(1)
        k(x)
        assert float(x[0]) == float(src.split("+= ")[1].split(".")[0])
        errs.append(capsys.readouterr().err)
    assert errs[0].count("building the C++ CPU kernels") == 1 and not errs[1], errs
    cb.cpu_kernel.cache_clear()                   # a later process: the same source again
    monkeypatch.setattr(cb, "_told", [False])
    cb.cpu_kernel(sources[0], ("float*",))
    assert not capsys.readouterr().err


@pytest.mark.parametrize("kind,i", [   # the first of each kind here, the rest with -m slow
    pytest.param(kind, i, marks=() if i == 0 else pytest.mark.slow)
    for kind in ("raw", "chat") for i in range(5)])
def test_fast_path_greedy_matches_llama_cpp_on_the_parity_prompts(engines, smollm2_f32_path,
                                                                   kind, i):
    """test_llama_parity's prompts, 64 greedy tokens, the fast path's decode steps against
    llama.cpp on the F32 GGUF of the same weights: equal, or apart only at a near tie."""
    from llama_oracle import llama_cpp, llama_cpp_greedy
    from test_llama_parity import CHAT_PROMPTS, N_GREEDY, RAW_PROMPTS, chatml
    fast, _ = engines
    text = chatml(CHAT_PROMPTS[i]) if kind == "chat" else RAW_PROMPTS[i]
    llm = llama_cpp(smollm2_f32_path)
    try:
        tokens = llm.tokenize(text.encode(), add_bos=False, special=True)
        ref, gaps = llama_cpp_greedy(llm, tokens, N_GREEDY)
    finally:
        llm.close()
    fast.store.reset()
    fast.executor.begin_request(len(tokens) + N_GREEDY)
    logits, ours = fast.executor.step(tokens, 0), []
    for step in range(N_GREEDY):
        ours.append(int(logits.argmax()))
        logits = fast.executor.step([ours[-1]], len(tokens) + step)
    for step, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert gaps[step] < 0.05, f"greedy tokens diverge at step {step} without a near tie"
            return

