"""PrefillAccumulator (ops/span_attention/prefill_chunks.py): prefill attention over a
layer's KV consumed in staged pieces, every query tile per piece.

Checked: any split of the pages gives bitwise the one-launch prefill kernel's output
(pieces read in place, from another placement, or staged one after another into the same
small ring whose slots are spoiled after each piece), and the fp64 oracle within TOL.
CPU: the kernels run under TRITON_INTERPRET=1 in a child process (this file run as a
script) at small sizes; without the interpreter the CPU path equals the CPU op bitwise.
GPU (marked): q8_0/q4_0, bf16/bf16, f16/q8_0 x head dims 64/128/256 x uneven splits,
contexts not a multiple of the page size. Outputs are taken in fp32 (`out=`).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import kvcompile.ops  # noqa: F401
from kernel_oracle import args_of, dense_reference, fresh_seed, rel_err
from kernel_oracle import build as build_placed
from kvcompile.errors import KvLayoutError
from kvcompile.ops import kv_format as F

TOL = 1e-3
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def build(k_name, v_name, n_ctx, n_rows, head_dim, n_kv, group, page_size, q_dtype, gen,
          device="cpu", scattered_rows=False, table_pad=0):
    """Op arguments per placement (resident, ring_wrap) of fresh KV and queries
    (kernel_oracle.build)."""
    q, q_pos, placed = build_placed(k_name, v_name, n_ctx, n_rows, head_dim, n_kv, group,
                                    page_size, q_dtype, gen, ("resident", "ring_wrap"), device,
                                    scattered_rows, table_pad)
    return {name: args_of(k_name, v_name, q, q_pos, *pl, page_size)
            for name, pl in placed.items()}


def stage(ring_k, ring_v, k_pool, v_pool, piece, cursor):
    """Copy a piece's pages into consecutive ring slots from `cursor` (wrapping); its
    table there."""
    slots = (cursor + torch.arange(piece.shape[0], device=piece.device)) % ring_k.shape[0]
    ring_k[slots] = k_pool[piece.long()]
    ring_v[slots] = v_pool[piece.long()]
    return slots.int()


def run_job(job: dict) -> torch.Tensor:
    """job: args (the op's), opts (launcher options), pieces (page counts, or None for
    one launch), staged (stage every piece into one small reused ring), seed."""
    from kvcompile.ops.span_attention.prefill_chunks import PrefillAccumulator, workspace_numel
    from kvcompile.ops.span_attention.prefill_kernel import span_attention_prefill
    a, opts = job["args"], job.get("opts", {})
    q = a["q"]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if job["pieces"] is None:
        return span_attention_prefill(**a, out=out, **opts)
    gen = torch.Generator(q.device).manual_seed(job["seed"])
    # a caller's workspace full of NaN: the first piece must not read it
    ws = torch.full((workspace_numel(*q.shape),), float("nan"), device=q.device)
    table, kp, vp = a["page_table"], a["k_pool"], a["v_pool"]
    acc = PrefillAccumulator(q, a["q_pos"], a["k_type"], a["v_type"], a["page_size"],
                             a["scale"], table.shape[0], out=out, workspace=ws, **opts)
    n_slots = max(job["pieces"]) + 1
    ring_k = torch.randint(0, 256, (n_slots, kp.shape[1]), dtype=torch.uint8, generator=gen,
                           device=q.device)
    ring_v = torch.randint(0, 256, (n_slots, vp.shape[1]), dtype=torch.uint8, generator=gen,
                           device=q.device)
    # a windowed layer's pieces start at the first page some row's window reaches
    first, cursor, res = acc.first_page, n_slots - 1, None
    for n in job["pieces"]:
        piece = table[first:first + n]
        if job.get("staged"):
            piece = stage(ring_k, ring_v, kp, vp, piece, cursor)
            res = acc.consume(ring_k, ring_v, piece)
            # released: the next piece's copies may overwrite these slots
            ring_k[piece.long()] = torch.randint(0, 256, (n, kp.shape[1]), dtype=torch.uint8,
                                                 generator=gen, device=q.device)
            ring_v[piece.long()] = torch.randint(0, 256, (n, vp.shape[1]), dtype=torch.uint8,
                                                 generator=gen, device=q.device)
            cursor = (cursor + n) % n_slots
        else:
            res = acc.consume(kp, vp, piece)
        assert (res is out) == (first + n == table.shape[0])
        first += n
    assert acc.done
    return out


def jobs_of(placed, splits, opts, seed):
    """One-launch (resident), then per split: in place, staged; the middle split also read
    from the ring_wrap placement. Returns (labels, jobs)."""
    labels, jobs = ["one"], [dict(args=placed["resident"], opts=opts, pieces=None)]
    for i, sp in enumerate(splits):
        for name, staged in [("resident", False), ("resident", True)] + \
                ([("ring_wrap", False)] if i == (len(splits) - 1) // 2 else []):
            labels.append(f"{sp}-{name}{'-staged' if staged else ''}")
            jobs.append(dict(args=placed[name], opts=opts, pieces=sp, staged=staged,
                             seed=seed + len(jobs)))
    return labels, jobs


def check(case, placed, labels, outs, window=0):
    a = placed["resident"]
    kn, vn = F.kv_type(a["k_type"]).name, F.kv_type(a["v_type"]).name
    ref = dense_reference(a["q"], a["k_pool"], a["v_pool"], a["page_table"], a["q_pos"], kn, vn,
                          a["page_size"], a["scale"], window)
    one = outs[0]
    errs = {lab: rel_err(o, ref) for lab, o in zip(labels, outs)}
    same = {lab: torch.equal(o, one) for lab, o in zip(labels, outs)}
    print(f"{case}: bitwise == one launch {same}; max rel err vs fp64 {max(errs.values()):.2e}")
    assert all(same.values()), f"{case}: a split differs from the one launch: {same}"
    assert max(errs.values()) <= TOL


# ---- CPU: interpreted kernels ----------------------------------------------------------------
# (id, k, v, n_ctx, rows, head_dim, n_kv, group, page, q dtype, splits, opts, build extras)
BF, HF = torch.bfloat16, torch.float16
SMALL = dict(block_m=16, block_n=16)
CPU_CASES = [
    # a whole prompt: early query tiles end before later pieces (their state is skipped)
    ("Kq8_0-Vq4_0-D64-full-prompt", "q8_0", "q4_0", 70, 70, 64, 2, 2, 16, BF,
     [[1, 4], [2, 2, 1], [1, 1, 1, 1, 1]], SMALL, {}),
    ("Kbf16-Vbf16-D128", "bf16", "bf16", 40, 17, 128, 1, 2, 16, BF, [[1, 2]], SMALL, {}),
    # pages of 32 in tiles of 16: pieces hold several key tiles
    ("Kf16-Vq8_0-P32-ctx77", "f16", "q8_0", 77, 12, 64, 1, 2, 32, HF, [[1, 2], [2, 1]], SMALL,
     {}),
    ("Kq4_0-Vq8_0-D256", "q4_0", "q8_0", 40, 17, 256, 1, 2, 16, HF, [[2, 1]], SMALL, {}),
    # rows in any order, and table pages past the context (pieces of unread pages)
    ("Kq8_0-Vbf16-scattered-long-table", "q8_0", "bf16", 90, 24, 64, 2, 2, 16, BF,
     [[3, 8], [6, 5]], SMALL, dict(scattered_rows=True, table_pad=5)),
    # a sliding window of 20 over rows 60..89: pieces from page 2, the first the windows reach
    ("Kq8_0-Vq4_0-window20", "q8_0", "q4_0", 90, 30, 64, 2, 2, 16, BF, [[1, 3], [2, 1, 1]],
     dict(SMALL, window=20), {}),
    # quantized pages dequantized to fp16 a span of two pages at a time (dequant_pages.py),
    # forced at few rows: spans inside pieces and pieces inside spans
    ("Kq8_0-Vq4_0-dequantized", "q8_0", "q4_0", 70, 40, 64, 2, 2, 16, BF, [[1, 4], [3, 2]],
     dict(SMALL, dequant_rows=1, dequant_tokens=32), {}),
    ("Kq4_0-Vq8_0-dequantized-window20", "q4_0", "q8_0", 90, 30, 64, 2, 2, 16, HF, [[1, 3]],
     dict(SMALL, window=20, dequant_rows=1, dequant_tokens=32), {}),
]


def run_interpreted(jobs: list[dict], timeout: int = 600) -> list[torch.Tensor]:
    with tempfile.TemporaryDirectory() as tmp:
        inp, outp = Path(tmp) / "jobs.pt", Path(tmp) / "results.pt"
        torch.save(jobs, inp)
        env = dict(os.environ, TRITON_INTERPRET="1")
        t0 = time.time()
        proc = subprocess.run([sys.executable, __file__, str(inp), str(outp)], env=env,
                              capture_output=True, text=True, timeout=timeout)
        print(f"interpreter: {len(jobs)} jobs in {time.time() - t0:.1f}s")
        if proc.returncode != 0:
            raise RuntimeError(f"interpreter child failed:\n{proc.stdout}\n{proc.stderr}")
        return torch.load(outp)


@pytest.fixture(scope="module")
def interp_runs():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    all_jobs, where = [], {}
    for cid, kn, vn, n_ctx, rows, d, n_kv, g, p, qd, splits, opts, extra in CPU_CASES:
        placed = build(kn, vn, n_ctx, rows, d, n_kv, g, p, qd, gen, **extra)
        labels, jobs = jobs_of(placed, splits, opts, seed)
        where[cid] = (placed, labels, len(all_jobs), len(all_jobs) + len(jobs))
        all_jobs += jobs
    return where, run_interpreted(all_jobs)


@pytest.mark.parametrize("case", [c[0] for c in CPU_CASES])
def test_interpreted_pieces_bitwise_equal_one_launch(interp_runs, case):
    where, outs = interp_runs
    placed, labels, lo, hi = where[case]
    opts = next(c[11] for c in CPU_CASES if c[0] == case)
    check(case, placed, labels, outs[lo:hi], opts.get("window", 0))


# ---- CPU without Triton: the reference path ------------------------------------------------

def test_cpu_reference_path_equals_cpu_op():
    from kvcompile.ops.span_attention.prefill_chunks import PrefillAccumulator
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    placed = build("q8_0", "q4_0", 100, 30, 64, 2, 2, 16, BF, gen, table_pad=2)
    a = placed["ring_wrap"]
    want = torch.ops.kvcompile.span_attention(**a)
    for pieces in ([9], [1, 4, 4], [2, 2, 2, 2, 1]):
        # run_job's fp32 out holds the reference's bf16 result
        acc_out = run_job(dict(args=a, pieces=pieces, staged=True, seed=seed))
        assert torch.equal(acc_out, want.float()), pieces
    ref = dense_reference(a["q"], a["k_pool"], a["v_pool"], a["page_table"], a["q_pos"], "q8_0",
                          "q4_0", 16, a["scale"])
    err = rel_err(want.float(), ref)
    print(f"CPU reference path == CPU op bitwise; op vs fp64 {err:.2e}")
    assert err <= 4e-3   # the op's bf16 output: one bf16 rounding
    acc = PrefillAccumulator(a["q"], a["q_pos"], a["k_type"], a["v_type"], 16, a["scale"],
                             9, use_kernel=False)
    assert acc.consume(a["k_pool"], a["v_pool"], a["page_table"][:5]) is None
    assert torch.equal(acc.consume(a["k_pool"], a["v_pool"], a["page_table"][5:]), want)


def test_bad_inputs_raise_clear_errors():
    from kvcompile.ops.span_attention.prefill_chunks import PrefillAccumulator
    gen = torch.Generator().manual_seed(fresh_seed())
    a = build("q8_0", "q4_0", 40, 20, 64, 2, 2, 16, BF, gen)["resident"]
    q, table, kp, vp = a["q"], a["page_table"], a["k_pool"], a["v_pool"]

    def acc(**kw):
        return PrefillAccumulator(q, a["q_pos"], a["k_type"], a["v_type"], 16, a["scale"],
                                  **dict(dict(n_pages=3, use_kernel=False), **kw))

    for kw, text in [(dict(n_pages=0), "n_pages must be a positive"),
                     (dict(out=torch.empty(3, 4, 64)), "out must be"),
                     (dict(workspace=torch.empty(10 ** 6, dtype=torch.float16)), "float32"),
                     (dict(workspace=torch.empty(100)), "at least")]:
        with pytest.raises(KvLayoutError, match=text):
            acc(**kw)
    with pytest.raises(KvLayoutError, match="q must be"):
        PrefillAccumulator(q[0], a["q_pos"], a["k_type"], a["v_type"], 16, 1.0, 3)
    x = acc()
    with pytest.raises(KvLayoutError, match="expected a piece from logical page 0, got 1"):
        x.consume(kp, vp, table[1:2], first_page=1)
    with pytest.raises(KvLayoutError, match="does not fit"):
        x.consume(kp, vp, torch.cat([table, table[:1]]))
    with pytest.raises(KvLayoutError, match="does not fit"):
        x.consume(kp, vp, table[:0])
    with pytest.raises(KvLayoutError, match="1-D"):
        x.consume(kp, vp, table[None])
    with pytest.raises(KvLayoutError, match="same number of pages"):
        x.consume(kp, vp[:-1], table)
    with pytest.raises(KvLayoutError, match="piece_table entries 0..1 name physical pages"):
        x.consume(kp, vp, torch.tensor([0, kp.shape[0]], dtype=table.dtype))
    with pytest.raises(KvLayoutError, match="piece_table entries 0 and 1 both name"):
        x.consume(kp, vp, table[:1].repeat(2))
    assert x.consume(kp, vp, table[:2]) is None
    with pytest.raises(KvLayoutError, match="logical page 2, got 0"):
        x.consume(kp, vp, table[:1], first_page=0)
    assert x.consume(kp, vp, table[2:]) is not None
    with pytest.raises(KvLayoutError, match="start a new"):
        x.consume(kp, vp, table[2:])
    short = PrefillAccumulator(q, a["q_pos"], a["k_type"], a["v_type"], 16, a["scale"], 2,
                               use_kernel=False)
    short.consume(kp, vp, table[:1])
    with pytest.raises(KvLayoutError, match="past the 2 pages"):
        short.consume(kp, vp, table[1:2])


# ---- CPU: what the kernel variants compile to for sm_90 (offline, no GPU needed) -----------

def float_ops(k_type, v_type, d, load_state, finish, windowed=False):
    """Floating-point PTX instructions, in order, of one _prefill variant (fp32 out)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvcompile.ops.span_attention.launch import dot_mode, k_split
    from kvcompile.ops.span_attention.prefill_kernel import _prefill, prefill_config
    view = {0: "*fp32", 1: "*fp16", 30: "*bf16", 8: "*i8", 2: "*u8"}
    qk_f16 = dot_mode(torch.bfloat16, k_type)
    ptrs = dict(q_ptr="*fp16" if qk_f16 else "*bf16", k_vals=view[k_type], k_scl="*fp16",
                v_vals=view[v_type], v_scl="*fp16", page_table="*i32", q_pos_ptr="*i32",
                out_ptr="*fp32", ws_ptr="*fp32")
    bm, bn, nw, ns = prefill_config(d, 256)
    cx = dict(QK_SCALE=0.125, G=4, D=d, P=256, BLOCK_M=bm, BLOCK_N=bn, K_TYPE=k_type,
              V_TYPE=v_type, QK_F16=qk_f16, K_SPLIT=k_split(k_type), LOAD_STATE=load_state,
              FINISH=finish, WINDOWED=windowed, INTERP=False)
    sig = {n: ptrs.get(n, "constexpr" if n in cx else "i32") for n in _prefill.arg_names}
    kernel = triton.compile(ASTSource(fn=_prefill, signature=sig, constexprs=cx),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=nw, num_stages=ns))
    ops = [line.split()[0] for line in kernel.asm["ptx"].splitlines()
           if line.startswith("\t") and line.strip() and not line.strip().startswith(("//", "."))]
    return [o for o in ops if any(t in o for t in (".f32", ".f16", ".bf16", "mma", "ex2"))]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                    reason="compiles the kernel itself, not its interpreted form")
@pytest.mark.parametrize("k_name,v_name,windowed", [("q8_0", "q4_0", False),
                                                    ("bf16", "bf16", False),
                                                    ("q8_0", "q4_0", True)],
                         ids=["Kq8_0-Vq4_0", "Kbf16-Vbf16", "Kq8_0-Vq4_0-window"])
def test_sm90_variants_run_the_same_float_ops(k_name, v_name, windowed):
    """The one launch, the first, middle and last piece compile to the same floating-point
    instructions in the same order (pieces that do not finish lack only the normalizing
    divisions): the GPU-side reason any split is bitwise the one launch."""
    kt, vt = F.kv_type(k_name).ggml_id, F.kv_type(v_name).ggml_id
    one = float_ops(kt, vt, 128, False, True, windowed)
    last = float_ops(kt, vt, 128, True, True, windowed)
    first, middle = (float_ops(kt, vt, 128, load, False, windowed) for load in (False, True))
    divs = sum(o.startswith("div") for o in one)
    print(f"K{k_name}-V{v_name}: {len(one)} float instructions, {divs} divisions")
    assert divs > 0 and any("mma" in o for o in one)
    # Selects round nothing, so where they sit cannot change a bit: the newest Triton
    # schedules a windowed kernel's masking selects in another place per variant. Every
    # rounding instruction comes in the same order, the selects in the same number.
    def rounding(ops):
        return [o for o in ops if not o.startswith("selp")]

    def selects(ops):
        return len(ops) - len(rounding(ops))
    assert rounding(last) == rounding(one) and selects(last) == selects(one)
    no_div = [o for o in one if not o.startswith("div")]
    for piece in (first, middle):
        assert rounding(piece) == rounding(no_div) and selects(piece) == selects(no_div)


# ---- GPU -------------------------------------------------------------------------------------

def splits_of(n):
    """Uneven splits of n pages (n >= 10)."""
    q = n // 4
    return [[n], [1, n - 1], [5, 4, n - 9], [q, q, q, n - 3 * q], [1] * n]


GPU_CASES = [(kn, vn, qd, d) for kn, vn, qd in (("q8_0", "q4_0", BF), ("bf16", "bf16", BF),
                                                 ("f16", "q8_0", HF))
             for d in (64, 128, 256)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k_name,v_name,q_dtype,d", GPU_CASES,
                         ids=[f"K{k}-V{v}-D{d}" for k, v, _, d in GPU_CASES])
def test_gpu_pieces_bitwise_equal_one_launch(k_name, v_name, q_dtype, d):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    i = GPU_CASES.index((k_name, v_name, q_dtype, d))
    n_ctx = 2600 + 37 * i                       # never a multiple of the page size 256
    rows = n_ctx if i % 2 == 0 else 700         # a whole prompt, or the end of one
    placed = build(k_name, v_name, n_ctx, rows, d, 2, 3, 256, q_dtype, gen, "cuda",
                   table_pad=i % 3)
    n_pages = placed["resident"]["page_table"].shape[0]
    labels, jobs = jobs_of(placed, splits_of(n_pages), {}, seed)
    outs = [run_job(j) for j in jobs]
    check(f"K{k_name}-V{v_name}-D{d} ctx {n_ctx} rows {rows}", placed, labels, outs)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("window", [1, 300, 1024])
def test_gpu_windowed_pieces_bitwise_equal_one_launch(window):
    """A windowed layer's pieces, from the first page its windows reach: bitwise the one
    launch, within TOL of fp64."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    placed = build("q8_0", "q4_0", 5000, 700, 128, 2, 3, 256, BF, gen, "cuda")
    n_pages = placed["resident"]["page_table"].shape[0]
    first = max(5000 - 700 - window + 1, 0) // 256
    m = n_pages - first                          # 4 to 8 pages
    labels, jobs = jobs_of(placed, [[m], [1, m - 1], [2, 1, m - 3]], dict(window=window), seed)
    outs = [run_job(j) for j in jobs]
    check(f"window {window}", placed, labels, outs, window)


@pytest.mark.gpu
@gpu
def test_gpu_default_out_equals_op():
    """out=None: q's dtype, the op's own output (rows > 8 take the prefill kernel)."""
    from kvcompile.ops.span_attention.prefill_chunks import PrefillAccumulator
    gen = torch.Generator().manual_seed(fresh_seed())
    a = build("q8_0", "q4_0", 5000, 1200, 128, 4, 2, 256, BF, gen, "cuda")["ring_wrap"]
    acc = PrefillAccumulator(a["q"], a["q_pos"], a["k_type"], a["v_type"], 256, a["scale"],
                             a["page_table"].shape[0])
    for lo, hi in ((0, 7), (7, 8), (8, a["page_table"].shape[0])):
        res = acc.consume(a["k_pool"], a["v_pool"], a["page_table"][lo:hi])
    assert res.dtype == torch.bfloat16
    assert torch.equal(res, torch.ops.kvcompile.span_attention(**a))


if __name__ == "__main__":   # the interpreter child (TRITON_INTERPRET=1 from the parent)
    jobs_in = torch.load(sys.argv[1])
    torch.save([run_job(j) for j in jobs_in], sys.argv[2])
