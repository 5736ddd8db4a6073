"""Triton span_attention (decode split kernel, prefill kernel) against an fp64 dense
attention over the dequantized KV, and across physical placements of the same logical KV.

CPU: the kernels run under TRITON_INTERPRET=1 (child process, see kernel_oracle) at small
sizes. GPU (marked): every K/V type pair x both kernels x 1/2/4/8 rows x 3 placements,
and contexts up to 128K. Kernel outputs are taken in fp32 (`out=`) so the measured error
is the kernel's own; the op's bf16/f16 output is that value rounded once (checked on GPU).
"""
from __future__ import annotations

import math

import pytest
import torch

import kvcompile.ops  # noqa: F401
from kernel_oracle import (PAIRS, args_of, build, dense_reference, fresh_seed,
                           paired_pools, rel_err, run_interpreted, spaced_pools,
                           stale_before_window)
from kvcompile.errors import KvLayoutError
from kvcompile.kv.rotation import V_BLOCK, diagonal_blocks, v_rotation
from kvcompile.ops import kv_format as F
from kvcompile.ops.span_attention.decode_transposed import transposed_takes

TOL = 1e-3
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9  # TMA


# ---- interpreter cases: (id, kernel, k, v, n_ctx, rows, head_dim, n_kv, group, P, q dtype,
#      plans, launcher options) ----------------------------------------------------------------
ALL3 = ("resident", "mixed", "ring_wrap")
TWO = ("resident", "ring_wrap")
QD = {0: torch.bfloat16, 1: torch.float16}
SMALL = dict(block_n=16)
INTERP = []
for i, (kn, vn) in enumerate(PAIRS):
    qd = QD[i % 2]
    INTERP.append((f"decode-K{kn}-V{vn}-rows4-ctx77", "decode", kn, vn, 77, 4, 64, 2, 2, 32,
                   qd, TWO, dict(SMALL, chunk_len=32)))
    INTERP.append((f"prefill-K{kn}-V{vn}-rows12-ctx60", "prefill", kn, vn, 60, 12, 64, 2, 2,
                   16, qd, TWO, dict(SMALL, block_m=16)))
for rows in (1, 2, 8):
    INTERP.append((f"decode-Kq8_0-Vq4_0-rows{rows}-ctx70", "decode", "q8_0", "q4_0", 70, rows,
                   64, 2, 4, 16, torch.bfloat16, ALL3, dict(SMALL, chunk_len=16)))
    INTERP.append((f"prefill-Kq8_0-Vq4_0-rows{rows}-ctx70", "prefill", "q8_0", "q4_0", 70, rows,
                   64, 2, 4, 16, torch.bfloat16, ALL3, dict(SMALL, block_m=16)))
for kn, vn, qd in (("bf16", "bf16", torch.bfloat16), ("q8_0", "q4_0", torch.bfloat16),
                   ("q4_0", "q8_0", torch.float16)):
    for d in (128, 256):
        INTERP.append((f"decode-K{kn}-V{vn}-D{d}-ctx40", "decode", kn, vn, 40, 2, d, 1, 3, 16,
                       qd, ("resident",), dict(SMALL, chunk_len=32)))
        INTERP.append((f"prefill-K{kn}-V{vn}-D{d}-ctx40", "prefill", kn, vn, 40, 17, d, 1, 2,
                       16, qd, ("resident",), dict(SMALL, block_m=16)))
# the output rotation folded into the decode reduce (out_rot as diagonal blocks
# [NB, B, B]): random orthogonal blocks (the op takes any), and the V rotation the cache uses
_rot_gen = torch.Generator().manual_seed(fresh_seed())


def random_rotation(d: int, gen, block: int | None = None) -> torch.Tensor:
    """[d / block, block, block] random orthogonal blocks (one [1, d, d] by default)."""
    b = block or d
    q = torch.linalg.qr(torch.randn(d // b, b, b, generator=gen, dtype=torch.float64))[0]
    return q.float().contiguous()


INTERP += [
    ("decode-outrot-Kq8_0-Vq4_0-rows2-ctx70", "decode", "q8_0", "q4_0", 70, 2, 64, 2, 4, 16,
     torch.bfloat16, TWO, dict(SMALL, chunk_len=16, out_rot=random_rotation(64, _rot_gen))),
    ("decode-outrot32-Kq4_0-Vq8_0-rows3-ctx50", "decode", "q4_0", "q8_0", 50, 3, 64, 2, 2, 16,
     torch.float16, TWO, dict(SMALL, chunk_len=16, out_rot=random_rotation(64, _rot_gen, 32))),
    ("decode-outrot-Kbf16-Vq8_0-D128-ctx40", "decode", "bf16", "q8_0", 40, 1, 128, 1, 3, 16,
     torch.float16, ("resident",), dict(SMALL, chunk_len=32, out_rot=diagonal_blocks(
         v_rotation(F.kv_type("q8_0"), 128), V_BLOCK))),
]
INTERP += [
    ("decode-ctx1", "decode", "q8_0", "q4_0", 1, 1, 64, 2, 2, 16, torch.bfloat16, ALL3, SMALL),
    ("prefill-ctx1", "prefill", "q8_0", "q4_0", 1, 1, 64, 2, 2, 16, torch.bfloat16, ALL3,
     dict(SMALL, block_m=16)),
    ("decode-P256-ctx300-default-chunks", "decode", "q8_0", "q4_0", 300, 3, 64, 2, 2, 256,
     torch.bfloat16, ("resident", "ring_wrap"), {}),
    ("prefill-P256-ctx300", "prefill", "bf16", "bf16", 300, 40, 64, 1, 2, 256, torch.bfloat16,
     ("resident", "ring_wrap"), dict(block_m=32, block_n=64)),
    # four tiles a chunk over two pages, the context ending inside a tile: the transposed
    # decode's scales read a tile ahead and their page two tiles ahead reach real pages
    ("decode-Kq8_0-Vq4_0-ctx77-P32-4tiles-a-chunk", "decode", "q8_0", "q4_0", 77, 1, 64, 2, 4,
     32, torch.bfloat16, ALL3, dict(SMALL, chunk_len=64)),
    # queries with outlier channels (x40 on 4 dims, as real models' queries have): Q.K must
    # stay exact where one block's values span a wide range
    ("decode-Kq8_0-Vq4_0-D256-q-outliers", "decode", "q8_0", "q4_0", 100, 1, 256, 1, 6, 32,
     torch.bfloat16, ("resident",), dict(SMALL, chunk_len=64), dict(q_outliers=4)),
    ("prefill-Kq4_0-Vq8_0-D128-q-outliers", "prefill", "q4_0", "q8_0", 60, 5, 128, 1, 4, 32,
     torch.float16, ("resident",), dict(SMALL, block_m=16), dict(q_outliers=4)),
    # rows at scattered positions in any order, and a page table longer than the context
    ("decode-scattered-rows-long-table", "decode", "q4_0", "f16", 90, 5, 64, 2, 2, 16,
     torch.float16, ALL3, dict(SMALL, chunk_len=32), dict(scattered_rows=True, table_pad=5)),
    ("prefill-scattered-rows-long-table", "prefill", "q8_0", "bf16", 90, 24, 64, 2, 2, 16,
     torch.bfloat16, ALL3, dict(SMALL, block_m=16), dict(scattered_rows=True, table_pad=5)),
]
# sliding windows (span_attention's `window`): rows attend to their last W positions only.
# Each also runs with the pages before every row's window pointed at a garbage page
# ("stale"): nothing of them may be read. Windows shorter than a tile, than a chunk, than
# the rows of a prefill tile; scattered rows; one longer than the context
WIN = ALL3 + ("stale",)
INTERP += [
    ("decode-window24-Kq8_0-Vq4_0-rows4-ctx77", "decode", "q8_0", "q4_0", 77, 4, 64, 2, 2, 16,
     torch.bfloat16, WIN, dict(SMALL, chunk_len=32, window=24)),
    *[(f"decode-window30-Kq8_0-Vq4_0-rows{r}-ctx70", "decode", "q8_0", "q4_0", 70, r, 64, 2,
       2, 16, torch.bfloat16, WIN, dict(SMALL, chunk_len=16, window=30)) for r in (1, 8)],
    ("decode-window1-Kf16-Vbf16-rows2-ctx50", "decode", "f16", "bf16", 50, 2, 64, 2, 2, 16,
     torch.float16, ("resident", "stale"), dict(SMALL, chunk_len=16, window=1)),
    ("decode-window37-scattered-rows", "decode", "q4_0", "q8_0", 90, 5, 64, 2, 2, 16,
     torch.float16, WIN, dict(SMALL, chunk_len=32, window=37), dict(scattered_rows=True)),
    ("prefill-window24-Kq8_0-Vq4_0-rows40-ctx90", "prefill", "q8_0", "q4_0", 90, 40, 64, 2, 2,
     16, torch.bfloat16, WIN, dict(SMALL, block_m=16, window=24)),
    ("prefill-window50-Kbf16-Vf32-rows12-ctx60", "prefill", "bf16", "f32", 60, 12, 64, 1, 2, 16,
     torch.bfloat16, ("resident", "stale"), dict(SMALL, block_m=16, window=50)),
    ("prefill-window200-longer-than-ctx", "prefill", "f16", "f16", 60, 12, 64, 1, 2, 16,
     torch.float16, ("resident",), dict(SMALL, block_m=16, window=200)),
]
# prefill launches that dequantize quantized pages to fp16 once (dequant_pages.py), forced at
# few rows: spans of two pages, the softmax state carried from span to span; a float pool
# beside a quantized one; a window (pages before it never dequantized, nor read)
STAGED = dict(SMALL, block_m=16, dequant_rows=1, dequant_tokens=32)
INTERP += [
    ("prefill-dequant-Kq8_0-Vq4_0-rows20-ctx70", "prefill", "q8_0", "q4_0", 70, 20, 64, 2, 2,
     16, torch.bfloat16, ALL3, STAGED),
    ("prefill-dequant-Kbf16-Vq8_0-rows12-ctx60", "prefill", "bf16", "q8_0", 60, 12, 64, 2, 2,
     16, torch.bfloat16, TWO, STAGED),
    ("prefill-dequant-Kq4_0-Vq8_0-D128-rows17-ctx40", "prefill", "q4_0", "q8_0", 40, 17, 128, 1,
     2, 16, torch.float16, ("resident",), STAGED),
    ("prefill-dequant-window24-Kq8_0-Vq4_0-rows40-ctx90", "prefill", "q8_0", "q4_0", 90, 40, 64,
     2, 2, 16, torch.bfloat16, WIN, dict(STAGED, window=24)),
]
OPTS = 12   # index of the launcher options in a case


def _with_impl(case, impl, suffix):
    return (case[0] + suffix, *case[1:OPTS], dict(case[OPTS], impl=impl), *case[OPTS + 1:])


QUANT = ("q8_0", "q4_0")
DECODE_CASES = [c for c in INTERP if c[1] == "decode"]
# every decode case on each implementation that takes it: the base ids run legacy, "-blocks"
# the blocks kernel, "-transposed" the transposed one (quantized K and V, at most 16 query
# rows a KV head: rows x group); the op's choice among them has its own test
INTERP = [_with_impl(c, "legacy", "") if c[1] == "decode" else c for c in INTERP]
INTERP += [_with_impl(c, "blocks", "-blocks") for c in DECODE_CASES]
INTERP += [_with_impl(c, "transposed", "-transposed") for c in DECODE_CASES
           if transposed_takes(c[2] in QUANT, c[3] in QUANT, c[5] * c[8])]
# the transposed kernel again with its codes read through TMA descriptors (tma_codes; the
# interpreter reads descriptors like the GPU's untraced launches)
INTERP += [(c[0] + "-tma", *c[1:OPTS], dict(c[OPTS], tma=True), *c[OPTS + 1:])
           for c in INTERP if c[0].endswith("-transposed")]
INTERP_IDS = [c[0] for c in INTERP]
# the blocks kernel again over every decode case, and the TMA reads of the transposed one:
# with `-m slow` (CI runs both); the README's test command runs the rest
EXHAUSTIVE = {c[0] for c in INTERP if c[0].endswith(("-blocks", "-tma"))}
# cases also run with q as a head slice of a wider tensor (the model splits q off one
# [T, Hq + Hk, D] rope output): placement "strided_q" must equal "resident" bitwise
STRIDED_Q = {"decode-Kq8_0-Vq4_0-rows8-ctx70", "decode-Kq8_0-Vq4_0-rows8-ctx70-blocks",
             "decode-Kq8_0-Vq4_0-rows2-ctx70-transposed",
             "prefill-Kq8_0-Vq4_0-rows8-ctx70", "decode-Kbf16-Vbf16-D128-ctx40-blocks",
             "prefill-dequant-Kq8_0-Vq4_0-rows20-ctx70"}
assert STRIDED_Q <= set(INTERP_IDS)
# cases also run on pools that are views of one page-pair buffer (the streaming cache's
# layout, pages further apart than their size), and on K and V pages spaced by different
# strides: placements "paired" and "spaced" equal "resident" bitwise
PAIRED = {"decode-Kq8_0-Vq4_0-rows8-ctx70", "decode-Kq8_0-Vq4_0-rows8-ctx70-blocks",
          "decode-Kq8_0-Vq4_0-rows2-ctx70-transposed",
          "decode-Kq8_0-Vq4_0-rows2-ctx70-transposed-tma",
          "prefill-Kq8_0-Vq4_0-rows8-ctx70", "decode-Kbf16-Vbf16-D128-ctx40",
          "prefill-dequant-Kq8_0-Vq4_0-rows20-ctx70"}
assert PAIRED <= set(INTERP_IDS)


def head_slice(q: torch.Tensor, gen) -> torch.Tensor:
    """q's values as the first heads of a [T, Hq + 3, D] tensor (strides of a split)."""
    extra = torch.randn(q.shape[0], 3, q.shape[2], generator=gen).to(q.dtype)
    return torch.cat([q, extra], 1)[:, :q.shape[1]]


def _interp_runs(cases):
    gen = torch.Generator().manual_seed(fresh_seed())
    jobs, keys, inputs = [], [], {}
    for cid, kernel, kn, vn, n_ctx, rows, d, n_kv, g, p, qd, plans, opts, *extra in cases:
        window = opts.get("window", 0)
        q, q_pos, placed = build(kn, vn, n_ctx, rows, d, n_kv, g, p, qd, gen,
                                 [n for n in plans if n != "stale"],
                                 **(extra[0] if extra else {}))
        if "stale" in plans:
            table, kp, vp = placed["resident"]
            placed["stale"] = (stale_before_window(table, q_pos, window, p), kp, vp)
        inputs[cid] = (kn, vn, q, q_pos, placed, p, opts.get("out_rot"), window)
        for name, (table, kp, vp) in placed.items():
            jobs.append({"kind": kernel, "opts": opts,
                         "args": args_of(kn, vn, q, q_pos, table, kp, vp, p)})
            keys.append((cid, name))
        if cid in STRIDED_Q:
            table, kp, vp = placed["resident"]
            qs = head_slice(q, gen)
            assert not qs.is_contiguous() and torch.equal(qs, q)
            jobs.append({"kind": kernel, "opts": opts,
                         "args": args_of(kn, vn, qs, q_pos, table, kp, vp, p)})
            keys.append((cid, "strided_q"))
        if cid in PAIRED:
            table, kp, vp = placed["resident"]
            _, pk, pv = paired_pools(kp, vp, gen)
            assert pk.stride(0) > pk.shape[1] and torch.equal(pk, kp) and torch.equal(pv, vp)
            jobs.append({"kind": kernel, "opts": opts,
                         "args": args_of(kn, vn, q, q_pos, table, pk, pv, p)})
            keys.append((cid, "paired"))
            sk, sv = spaced_pools(kp, vp, gen)
            jobs.append({"kind": kernel, "opts": opts,
                         "args": args_of(kn, vn, q, q_pos, table, sk, sv, p)})
            keys.append((cid, "spaced"))
    outs = {}
    for key, res in zip(keys, run_interpreted(jobs)):
        outs.setdefault(key[0], {})[key[1]] = res["out"]
    return inputs, outs


@pytest.fixture(scope="module")
def interp_runs():
    return _interp_runs([c for c in INTERP if c[0] not in EXHAUSTIVE])


@pytest.fixture(scope="module")
def interp_runs_exhaustive():
    return _interp_runs([c for c in INTERP if c[0] in EXHAUSTIVE])


@pytest.mark.parametrize("case", [i for i in INTERP_IDS if i not in EXHAUSTIVE])
def test_interpreted_kernel_exact_and_placement_independent(interp_runs, case):
    check_interpreted(interp_runs, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", [i for i in INTERP_IDS if i in EXHAUSTIVE])
def test_interpreted_kernel_exact_and_placement_independent_exhaustive(
        interp_runs_exhaustive, case):
    check_interpreted(interp_runs_exhaustive, case)


def check_interpreted(runs, case):
    inputs, outs = runs
    kn, vn, q, q_pos, placed, p, out_rot, window = inputs[case]
    table, kp, vp = placed["resident"]
    ref = dense_reference(q, kp, vp, table, q_pos, kn, vn, p, q.shape[-1] ** -0.5, window)
    if out_rot is not None:
        ref = ref @ torch.block_diag(*out_rot.double())
    errs = {name: rel_err(o, ref) for name, o in outs[case].items()}
    print(f"{case}: max relative error vs fp64 per placement {errs}")
    assert max(errs.values()) <= TOL
    first = outs[case]["resident"]
    for name, o in outs[case].items():
        assert torch.equal(o, first), f"{name} placement differs from resident"


# ---- GPU -----------------------------------------------------------------------------------

def run_gpu(kernel, a, out_dtype=torch.float32):
    """kernel: "decode" (the op's default implementation), "decode-legacy",
    "decode-blocks", "decode-transposed" (launched as a benchmark does: traced, codes by
    pointers), "decode-transposed-tma" (untraced, as inside the op: codes by TMA) or
    "prefill"."""
    from torch._library.triton import set_wrap_triton_enabled

    from kvcompile.ops.span_attention.prefill_kernel import span_attention_prefill
    out = torch.empty(a["q"].shape, dtype=out_dtype, device="cuda")
    if not kernel.startswith("decode"):
        return span_attention_prefill(**a, out=out)
    fn = op_launcher(a["q"], a["k_pool"], a["k_type"], a["v_type"], a["page_size"],
                     impl_of(kernel))
    if kernel.endswith("-tma"):
        with set_wrap_triton_enabled(False):
            return fn(**a, out=out, tma=True)
    return fn(**a, out=out)


def impl_of(kernel: str) -> str | None:
    """The decode implementation a test kernel name runs ("decode-transposed-tma":
    transposed)."""
    return kernel.partition("-")[2].removesuffix("-tma") or None


DECODES = ("decode-legacy", "decode-blocks", "decode-transposed", "decode-transposed-tma")


def takes(kernel, k_name, v_name, rows_per_kv_head) -> bool:
    """Whether `kernel` takes this shape (the transposed decode: quantized K and V, at most
    16 query rows a KV head; the others everything)."""
    if kernel.endswith("-tma") and not HOPPER:
        return False
    return not kernel.startswith("decode-transposed") or transposed_takes(
        k_name in QUANT, v_name in QUANT, rows_per_kv_head)


GPU_PLACE = [(kn, vn, kernel, rows) for kn, vn in PAIRS for kernel in DECODES + ("prefill",)
             for rows in (1, 2, 4, 8) if takes(kernel, kn, vn, rows * 3)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k_name,v_name,kernel,rows", GPU_PLACE,
                         ids=[f"K{k}-V{v}-{ker}-rows{r}" for k, v, ker, r in GPU_PLACE])
def test_gpu_placement_independence(k_name, v_name, kernel, rows):
    gen = torch.Generator().manual_seed(fresh_seed())
    i = PAIRS.index((k_name, v_name))
    d = (64, 128, 256)[i % 3]
    qd = QD[i % 2]
    n_ctx = 1000 + 37 * i
    q, q_pos, placed = build(k_name, v_name, n_ctx, rows, d, 2, 3, 256, qd, gen, ALL3, "cuda")
    outs = {name: run_gpu(kernel, args_of(k_name, v_name, q, q_pos, *pl, 256))
            for name, pl in placed.items()}
    table, kp, vp = placed["resident"]
    ref = dense_reference(q, kp, vp, table, q_pos, k_name, v_name, 256, d ** -0.5)
    err = rel_err(outs["resident"], ref)
    same = {name: torch.equal(o, outs["resident"]) for name, o in outs.items()}
    print(f"D{d} ctx {n_ctx} q {qd}: bitwise equal {same}, max rel err vs fp64 {err:.2e}")
    assert all(same.values())
    assert err <= TOL
    if op_would_pick(kernel, q, kp, k_name, v_name):   # the op: fp32 result rounded once
        table, kp, vp = placed["ring_wrap"]
        a = args_of(k_name, v_name, q, q_pos, table, kp, vp, 256)
        assert torch.equal(torch.ops.kvcompile.span_attention(**a), outs["resident"].to(qd))


def op_launcher(q, k_pool, k_type, v_type, page_size, impl=None):
    """The decode launcher the op takes for these arguments (`impl` forces one)."""
    from kvcompile.ops.span_attention.decode_blocks import launcher_for
    n_kv = F.n_kv_heads_of(k_pool, F.kv_type(k_type), page_size, q.shape[2])
    return launcher_for(q, n_kv, k_type, v_type, impl)


def op_would_pick(kernel, q, k_pool, k_name, v_name) -> bool:
    """Whether the op itself dispatches this shape to `kernel` (decode-legacy, -blocks or
    -transposed)."""
    from kvcompile.ops.span_attention.decode_blocks import decode_launcher
    if not kernel.startswith("decode-"):
        return False
    return op_launcher(q, k_pool, k_name, v_name, 256) is decode_launcher(impl_of(kernel))


def query_case_ids(cases, tag: str) -> list[str]:
    """Readable ids of (K type, V type, query dtype, kernel, n) cases, n after `tag`."""
    return [f"K{k}-V{v}-q{str(q)[6:]}-{ker}-{tag}{n}" for k, v, q, ker, n in cases]


GPU_WINDOW = [(kn, vn, kernel, rows, w) for kn, vn in (("q8_0", "q4_0"), ("bf16", "bf16"))
              for kernel in DECODES + ("prefill",) for rows in (1, 8) for w in (1, 1000, 4096)
              if takes(kernel, kn, vn, rows * 3)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k_name,v_name,kernel,rows,window", GPU_WINDOW,
                         ids=[f"K{k}-V{v}-{ker}-rows{r}-window{w}"
                              for k, v, ker, r, w in GPU_WINDOW])
def test_gpu_window_exact_and_placement_independent(k_name, v_name, kernel, rows, window):
    """Sliding windows at 8K: within TOL of fp64, bitwise equal across placements, and with
    the pages before every row's window pointed at garbage (nothing of them is read)."""
    gen = torch.Generator().manual_seed(fresh_seed())
    rows = rows if kernel.startswith("decode") else 40 * rows
    q, q_pos, placed = build(k_name, v_name, 8269, rows, 128, 2, 3, 256, torch.bfloat16, gen,
                             ALL3, "cuda")
    table, kp, vp = placed["resident"]
    placed["stale"] = (stale_before_window(table, q_pos, window, 256), kp, vp)
    outs = {name: run_gpu(kernel, dict(args_of(k_name, v_name, q, q_pos, *pl, 256),
                                       window=window)) for name, pl in placed.items()}
    ref = dense_reference(q, kp, vp, table, q_pos, k_name, v_name, 256, 128 ** -0.5, window)
    err = rel_err(outs["resident"], ref)
    same = {name: torch.equal(o, outs["resident"]) for name, o in outs.items()}
    print(f"window {window}: bitwise equal {same}, max rel err vs fp64 {err:.2e}")
    assert all(same.values()) and err <= TOL


GPU_EXACT = [(kn, vn, qd, kernel, n_ctx)
             for kn, vn, qd in (("bf16", "bf16", torch.bfloat16), ("q8_0", "q4_0", torch.bfloat16),
                                ("f16", "f16", torch.float16), ("q4_0", "q8_0", torch.float16))
             for kernel in DECODES + ("prefill",)
             for n_ctx in (1, 255, 257, 4109, 32845, 131072) if takes(kernel, kn, vn, 16)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k_name,v_name,q_dtype,kernel,n_ctx", GPU_EXACT,
                         ids=query_case_ids(GPU_EXACT, "ctx"))
def test_gpu_exact_long_context(k_name, v_name, q_dtype, kernel, n_ctx):
    rows = min(n_ctx, 8 if kernel.startswith("decode") else 200)
    d = 128 if "q4_0" in (k_name, v_name) else 256
    err = gpu_error_vs_fp64(k_name, v_name, q_dtype, kernel, n_ctx, rows, d, 4, 2)
    print(f"ctx {n_ctx} rows {rows} D{d}: max relative error vs fp64 {err:.2e}")
    assert err <= TOL


def gpu_error_vs_fp64(k_name, v_name, q_dtype, kernel, n_ctx, rows, d, n_kv, group,
                      **build_opts) -> float:
    """Max relative error of `kernel` against the fp64 reference: fresh KV and queries for
    the last `rows` positions, pages placed in the ring with a wrap."""
    gen = torch.Generator().manual_seed(fresh_seed())
    q, q_pos, placed = build(k_name, v_name, n_ctx, rows, d, n_kv, group, 256, q_dtype, gen,
                             ("ring_wrap",), "cuda", **build_opts)
    table, kp, vp = placed["ring_wrap"]
    out = run_gpu(kernel, args_of(k_name, v_name, q, q_pos, table, kp, vp, 256))
    ref = dense_reference(q, kp, vp, table, q_pos, k_name, v_name, 256, d ** -0.5)
    return rel_err(out, ref)


GPU_OUTLIERS = [(kn, vn, qd, kernel, d) for kn, vn, qd in (("q8_0", "q4_0", torch.bfloat16),
                                                            ("q4_0", "q8_0", torch.float16),
                                                            ("bf16", "bf16", torch.bfloat16))
                for kernel in DECODES + ("prefill",) for d in (128, 256)
                if takes(kernel, kn, vn, 6)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k_name,v_name,q_dtype,kernel,d", GPU_OUTLIERS,
                         ids=query_case_ids(GPU_OUTLIERS, "D"))
def test_gpu_exact_with_query_outliers(k_name, v_name, q_dtype, kernel, d):
    """Queries with outlier channels (x40 on 4 dims): sharp softmax, blocks of Q spanning a
    wide range; the error against fp64 stays within the tolerance."""
    rows = 1 if kernel.startswith("decode") else 64
    err = gpu_error_vs_fp64(k_name, v_name, q_dtype, kernel, 32845, rows, d, 2,
                            6 if d == 256 else 4, q_outliers=4)
    print(f"D{d} rows {rows} outlier queries: max relative error vs fp64 {err:.2e}")
    assert err <= TOL


# tile widths with the warps the H200 sweeps ran them with (32 x 2, 128 x 4) and the default
TMA_TILES = [(kn, vn, d, bn) for kn, vn, d in (("q8_0", "q4_0", 128), ("q4_0", "q8_0", 256),
                                                 ("q4_0", "q4_0", 64), ("q8_0", "q8_0", 256))
             for bn in (32, 64, 128)]
TILE_WARPS = {32: 2, 64: None, 128: 4}


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (TMA)")
@pytest.mark.parametrize("k_name,v_name,d,block_n", TMA_TILES,
                         ids=[f"K{k}-V{v}-D{d}-bn{b}" for k, v, d, b in TMA_TILES])
def test_gpu_transposed_tma_equals_pointer_reads(k_name, v_name, d, block_n):
    """The transposed decode's codes by TMA (untraced) and by pointers (traced): the same
    bits, for 32-128 positions a tile, placed in the ring with a wrap, the context ending
    mid-tile (the interpreter covers 16)."""
    from torch._library.triton import set_wrap_triton_enabled

    from kvcompile.ops.span_attention.decode_transposed import span_attention_decode_transposed
    gen = torch.Generator().manual_seed(fresh_seed())
    q, q_pos, placed = build(k_name, v_name, 5000 + 7 * block_n, 2, d, 2, 3, 256, torch.float16,
                             gen, ("ring_wrap",), "cuda")
    a = args_of(k_name, v_name, q, q_pos, *placed["ring_wrap"], 256)
    outs = []
    for tma, traced in ((True, False), (False, True)):
        out = torch.empty(q.shape, dtype=torch.float32, device="cuda")
        with set_wrap_triton_enabled(traced):
            span_attention_decode_transposed(**a, out=out, block_n=block_n,
                                             num_warps=TILE_WARPS[block_n], tma=tma)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


GPU_ROT = [(kn, vn, kernel, d, n_ctx) for kn, vn in (("q8_0", "q4_0"), ("bf16", "bf16"))
           for kernel in DECODES for d in (64, 128, 256) for n_ctx in (257, 32845)
           if takes(kernel, kn, vn, 16)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k_name,v_name,kernel,d,n_ctx", GPU_ROT,
                         ids=[f"K{k}-V{v}-{ker}-D{d}-ctx{n}" for k, v, ker, d, n in GPU_ROT])
def test_gpu_decode_output_rotation(k_name, v_name, kernel, d, n_ctx):
    """out_rot inside the decode reduce: the fp32 output against (fp64 attention) @ rot,
    placement independent; through the op (f16 rows) equal to that output rounded once, and
    the prefill path (attention, then rope_rotate) within the f16 rounding of it."""
    gen = torch.Generator().manual_seed(fresh_seed())
    rot = random_rotation(d, gen, 64).cuda()
    dense = torch.block_diag(*rot.double())
    q, q_pos, placed = build(k_name, v_name, n_ctx, 4, d, 2, 4, 256, torch.float16, gen,
                             ALL3, "cuda")
    outs = {name: run_gpu(kernel, dict(args_of(k_name, v_name, q, q_pos, *pl, 256),
                                       out_rot=rot))
            for name, pl in placed.items()}
    table, kp, vp = placed["resident"]
    ref = dense_reference(q, kp, vp, table, q_pos, k_name, v_name, 256, d ** -0.5) @ dense
    err = rel_err(outs["resident"], ref)
    print(f"D{d} ctx {n_ctx}: max rel err vs fp64 attention @ rot {err:.2e}")
    assert err <= TOL
    assert all(torch.equal(o, outs["resident"]) for o in outs.values())
    a = dict(args_of(k_name, v_name, q, q_pos, table, kp, vp, 256), out_rot=rot)
    if op_would_pick(kernel, q, kp, k_name, v_name):
        assert torch.equal(torch.ops.kvcompile.span_attention(**a), outs["resident"].half())
    wide = q.repeat(3, 1, 1)[:9]                       # 9 rows: the prefill kernel
    wide_pos = torch.cat([q_pos] * 3)[:9]
    got = torch.ops.kvcompile.span_attention(**dict(a, q=wide, q_pos=wide_pos))
    want = dense_reference(wide, kp, vp, table, wide_pos, k_name, v_name, 256,
                           d ** -0.5) @ dense
    assert rel_err(got, want) <= 2 * TOL
    as_dense = torch.ops.kvcompile.span_attention(**dict(a, out_rot=dense.float()))
    assert rel_err(as_dense, ref) <= 2 * TOL           # a dense [D, D] is one block


# ---- which decode kernel the op takes (CPU) ------------------------------------------------

@pytest.mark.parametrize("k_name,v_name,rows,group,want", [
    ("q8_0", "q4_0", 1, 4, "transposed"), ("q4_0", "q8_0", 2, 4, "transposed"),
    ("q4_0", "q4_0", 1, 8, "transposed"),
    ("q8_0", "q8_0", 4, 4, "blocks"),        # 16 rows a KV head: blocks' tile is full
    ("q8_0", "q4_0", 8, 4, "blocks"),        # 32 rows a KV head: past the transposed's 16
    ("q8_0", "bf16", 1, 4, "blocks"), ("bf16", "q4_0", 1, 4, "blocks"),
    ("q8_0", "q4_0", 8, 6, "legacy"),        # 48 rows a KV head
    ("bf16", "bf16", 1, 4, "legacy"), ("f16", "f32", 8, 4, "legacy")])
def test_decode_choice_by_shape(k_name, v_name, rows, group, want):
    from kvcompile.ops.span_attention.decode_blocks import DECODE_IMPLS
    gen = torch.Generator().manual_seed(fresh_seed())
    q, q_pos, placed = build(k_name, v_name, 20, rows, 64, 2, group, 16, torch.float16, gen,
                             ("resident",))
    table, kp, vp = placed["resident"]
    assert op_launcher(q, kp, k_name, v_name, 16) is DECODE_IMPLS[want]


# ---- bad input (CPU, through the op) ---------------------------------------------------------

def bad_input_args(device="cpu") -> dict:
    """Valid op arguments to spoil: q8_0/q4_0 pages of 16, a 40-position context, 2 rows."""
    gen = torch.Generator().manual_seed(fresh_seed())
    q, q_pos, placed = build("q8_0", "q4_0", 40, 2, 64, 2, 2, 16, torch.bfloat16, gen,
                             device=device)
    table, kp, vp = placed["resident"]
    return args_of("q8_0", "q4_0", q, q_pos, table, kp, vp, 16)


def test_bad_inputs_raise_clear_errors():
    a = bad_input_args()
    q, q_pos, table, vp = a["q"], a["q_pos"], a["page_table"], a["v_pool"]
    op = torch.ops.kvcompile.span_attention
    bad = {
        "unknown type": (dict(a, k_type=6), "unsupported KV cache type"),
        "q heads vs kv heads": (dict(a, q=torch.randn(2, 3, 64).bfloat16()), "cannot share"),
        "q not 3-D": (dict(a, q=q[0]), "must be \\[T"),
        "q_pos length": (dict(a, q_pos=q_pos[:1]), "q_pos must be"),
        "pool pages differ": (dict(a, v_pool=vp[:-1]), "same number of pages"),
        "pool bytes vs head dim": (dict(a, q=torch.randn(2, 4, 256).bfloat16()), "KV pool must be"),
        "page table 2-D": (dict(a, page_table=table[None]), "1-D"),
        "out_rot shape": (dict(a, out_rot=torch.eye(32)), "out_rot must be a \\[64, 64\\]"),
        "out_rot blocks": (dict(a, out_rot=torch.eye(24).expand(3, 24, 24)), "NB \\* B = 64"),
    }
    for name, (kw, text) in bad.items():
        with pytest.raises(KvLayoutError, match=text):
            op(**kw)
        print(f"{name}: KvLayoutError mentioning {text!r}")
    with pytest.raises(KvLayoutError, match="head dim"):
        op(**dict(a, q=torch.randn(2, 4, 96).bfloat16()))
    # what only the Triton launchers need (checked before any launch)
    from kvcompile.ops.span_attention.decode_kernel import span_attention_decode
    with pytest.raises(KvLayoutError, match="page_table must be contiguous int32.*q_pos must"):
        span_attention_decode(**dict(a, page_table=table.long(), q_pos=q_pos.long()))



def index_value_cases(a):
    """Bad q_pos / page_table values (op arguments `a`, a 40-position context over 3 pages of
    16) and the KvLayoutError text each must raise."""
    table, q_pos, n_pages = a["page_table"], a["q_pos"], a["k_pool"].shape[0]
    dup = table.clone()
    dup[2] = dup[0]
    return {
        "table shorter than the context": (dict(a, page_table=table[:2]), "q_pos spans 38..39"),
        "negative q_pos": (dict(a, q_pos=q_pos - 39), "q_pos spans -1..0"),
        "page past the pools": (dict(a, page_table=table.clone().index_fill_(0, torch.tensor(
            [1], device=table.device), n_pages)), "name physical pages"),
        "negative page": (dict(a, page_table=table.clone().index_fill_(0, torch.tensor(
            [0], device=table.device), -1)), "name physical pages -1"),
        "two logical pages on one physical page": (dict(a, page_table=dup),
                                                   "page_table entries 0 and 2 both name"),
    }


def test_bad_index_values_raise_clear_errors_and_the_op_keeps_serving():
    a = bad_input_args()
    q, q_pos, table = a["q"], a["q_pos"], a["page_table"]
    op = torch.ops.kvcompile.span_attention
    want = op(**a)
    bad = dict(index_value_cases(a), **{
        "page size 0": (dict(a, page_size=0), "page size must be a positive"),
        "integer queries": (dict(a, q=q.long()), "floating dtype"),
        "float q_pos": (dict(a, q_pos=q_pos.float()), "q_pos must be int32"),
        "0-dim out_rot": (dict(a, out_rot=torch.tensor(1.0)), "out_rot must be"),
    })
    for name, (kw, text) in bad.items():
        with pytest.raises(KvLayoutError, match=text):
            op(**kw)
        print(f"{name}: KvLayoutError mentioning {text!r}")
    # entries past the last page read are not looked at (a cache's table is longer than its
    # context); no query rows is an empty answer; the op still answers as before
    padded = torch.cat([table, torch.tensor([-7, 10 ** 6], dtype=table.dtype)])
    assert torch.equal(op(**dict(a, page_table=padded)), want)
    assert op(**dict(a, q=q[:0], q_pos=q_pos[:0])).shape == (0, *q.shape[1:])
    assert torch.equal(op(**a), want)


@pytest.mark.gpu
@gpu
def test_gpu_index_values_checked_when_asked(monkeypatch):
    """On CUDA the values are read only with KVCOMPILE_CHECK_INDICES=1 (a sync a call)."""
    from kvcompile.ops import index_checks
    a = bad_input_args("cuda")
    table, q_pos = a["page_table"], a["q_pos"]
    monkeypatch.setattr(index_checks, "ENABLED", True)
    op = torch.ops.kvcompile.span_attention
    want = op(**a)
    for name, (kw, text) in index_value_cases(a).items():
        with pytest.raises(KvLayoutError, match=text):
            op(**kw)
        print(f"cuda, {name}: KvLayoutError mentioning {text!r}")
    assert torch.equal(op(**a), want)
    monkeypatch.setattr(index_checks, "ENABLED", False)
    assert not index_checks.values_readable(table, q_pos)


# ---- torch.compile sees the ops (CPU: reference ops; GPU: the Triton kernels) ---------------

def _write_then_attend(kp, vp, k, v, slots, q, table, q_pos, page):
    torch.ops.kvcompile.kv_write(kp, vp, k, v, slots, 8, 2, page)
    return torch.ops.kvcompile.span_attention(q, kp, vp, table, q_pos, 8, 2, page,
                                              q.shape[-1] ** -0.5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu])])
def test_compiled_matches_eager(device):
    gen = torch.Generator().manual_seed(fresh_seed())
    page, n_kv, d, n_ctx = 256 if device == "cuda" else 16, 2, 128, 700
    n_pages = math.ceil(n_ctx / page) + 1
    pools = [F.page_bytes(F.kv_type(t), page, n_kv, d) for t in ("q8_0", "q4_0")]
    k = torch.randn(n_ctx, n_kv, d, generator=gen).to(device)
    v = torch.randn(n_ctx, n_kv, d, generator=gen).to(device)
    q = torch.randn(4, 2 * n_kv, d, generator=gen).bfloat16().to(device)
    table = torch.randperm(n_pages, generator=gen)[:n_pages - 1].int().to(device)
    pos = torch.arange(n_ctx, device=device)
    slots = table[pos // page].long() * page + pos % page
    q_pos = torch.arange(n_ctx - 4, n_ctx, dtype=torch.int32, device=device)
    outs, written = [], []
    for fn in (_write_then_attend, torch.compile(_write_then_attend, fullgraph=True)):
        kp = torch.zeros(n_pages, pools[0], dtype=torch.uint8, device=device)
        vp = torch.zeros(n_pages, pools[1], dtype=torch.uint8, device=device)
        outs.append(fn(kp, vp, k, v, slots, q, table, q_pos, page))
        written.append((kp, vp))
    same_pools = all(torch.equal(a, b) for a, b in zip(*written))
    print(f"{device}: compiled == eager: out {torch.equal(*outs)}, pools {same_pools}")
    assert torch.equal(outs[0], outs[1])
    assert same_pools
