"""The row ops of a decoder layer (ops/rms_norm, ops/rope_rotate, ops/silu_mul): each
reference against an fp64 formula written here, each Triton kernel against its reference
(CPU: under TRITON_INTERPRET=1 in a child process, see kernel_oracle; GPU: compiled,
marked), with fresh random inputs. Tolerance: one rounding of the output dtype relative to
the largest output (the kernels and the references round the same fp32 value, computed in
another order)."""
from __future__ import annotations

import pytest
import torch

import kvcompile.ops  # noqa: F401
from kernel_oracle import fresh_seed, run_interpreted
from kvcompile.errors import KvcompileError, OpInputError
from kvcompile.kv_rotation import k_rotation, v_rotation
from kvcompile.models.layers import rope_rows, rope_tables
from kvcompile.ops import kv_format as F
from kvcompile.ops.rms_norm.naive import rms_norm_naive
from kvcompile.ops.rope_rotate.naive import rope_rotate_naive
from kvcompile.ops.silu_mul.naive import silu_mul_naive

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# one rounding of the output, relative to the largest output (2^-mantissa bits), plus the
# fp32 order of operations
TOL = {torch.float32: 2e-6, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}
# (head dim, rotary dim, neox, K type, V type): partial rotary, both pair layouts,
# rotations on K only, V only, both, none
ROPE_CASES = [(128, 128, False, "q8_0", "q4_0"), (64, 32, True, "q4_0", "f16"),
              (256, 256, True, "bf16", "q8_0"), (128, 64, False, "f16", "f16")]
ROPE_IDS = [f"D{d}-R{r}-{'neox' if n else 'pairs'}-K{k}-V{v}" for d, r, n, k, v in ROPE_CASES]


def rel_err(out, ref) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def norm_case(dtype, gen, rows=5, n=384):
    x = (torch.randn(rows, n, generator=gen) * 3).to(dtype)
    r = torch.randn(rows, n, generator=gen).to(dtype)
    w = torch.rand(n, generator=gen) + 0.5
    return x, r, w


def rope_case(head_dim, rot_dim, neox, k_name, v_name, dtype, gen, rows=3, hq=8, hk=2):
    x = (torch.randn(rows, hq + 2 * hk, head_dim, generator=gen) * 2).to(dtype)
    pos = torch.randint(0, 4000, (rows,), generator=gen)
    cos, sin = rope_tables(rot_dim, 4096, 10000.0)
    c, s = rope_rows(cos[pos], sin[pos], neox)
    return dict(x=x, cos=c, sin=s, neox=neox, n_rope=hq + hk,
                rot_a=k_rotation(F.kv_type(k_name), head_dim),
                rot_b=v_rotation(F.kv_type(v_name), head_dim)), (cos[pos], sin[pos])


# ---- references against fp64 formulas --------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_rms_norm_reference_against_fp64(dtype):
    gen = torch.Generator().manual_seed(fresh_seed())
    x, r, w = norm_case(dtype, gen)
    s, y = rms_norm_naive(x, w, 1e-5, r)
    s64 = x.double() + r.double()
    assert rel_err(s, s64) <= TOL[dtype]
    s64 = s.double()       # the norm sees the rounded sum, as the next layer would
    y64 = s64 / (s64.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * w.double()
    print(f"{dtype}: rel err {rel_err(y, y64):.2e}")
    assert rel_err(y, y64) <= TOL[dtype]


@pytest.mark.parametrize("case", ROPE_CASES, ids=ROPE_IDS)
def test_rope_rotate_reference_against_fp64(case):
    """The pairwise rope formula on angles (not the rope_rows tables), then the rotations."""
    gen = torch.Generator().manual_seed(fresh_seed())
    a, (cos, sin) = rope_case(*case, torch.float32, gen)
    d, r, neox = case[0], case[1], case[2]
    x = a["x"].double()
    q = x[:, :a["n_rope"]].clone()
    i = torch.arange(r // 2)
    lo, hi = (i, i + r // 2) if neox else (2 * i, 2 * i + 1)
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    xa, xb = x[:, :a["n_rope"], lo], x[:, :a["n_rope"], hi]
    q[..., lo], q[..., hi] = xa * c - xb * s, xb * c + xa * s
    v = x[:, a["n_rope"]:]
    if a["rot_a"] is not None:
        q = q @ a["rot_a"].double()
    if a["rot_b"] is not None:
        v = v @ a["rot_b"].double()
    got = rope_rotate_naive(**a)
    err = rel_err(got, torch.cat([q, v], 1))
    print(f"rel err {err:.2e}")
    assert err <= TOL[torch.float32]


def test_silu_mul_reference_against_fp64():
    gen = torch.Generator().manual_seed(fresh_seed())
    x = torch.randn(3, 2 * 700, generator=gen) * 4
    g, u = x.double().chunk(2, -1)
    assert rel_err(silu_mul_naive(x), g / (1 + (-g).exp()) * u) <= TOL[torch.float32]


# ---- Triton kernels under the interpreter -------------------------------------------------
def test_row_kernels_interpreted_match_references():
    """Every dtype; rope cases with partial rotary, both layouts, every rotation mix, a
    strided input (q/k/v heads sliced out of a wider projection), the rotation alone
    (n_rope = 0) and rope alone; norms with and without the residual, a row width that is
    not a power of two."""
    gen = torch.Generator().manual_seed(fresh_seed())
    jobs, refs, names = [], [], []
    for dn, dt in DTYPES.items():
        x, r, w = norm_case(dt, gen)
        jobs += [dict(kind="rms_norm", args=dict(x=x, weight=w, eps=1e-6, residual=r)),
                 dict(kind="rms_norm", args=dict(x=x, weight=w, eps=1e-6))]
        refs += [rms_norm_naive(x, w, 1e-6, r), rms_norm_naive(x, w, 1e-6)]
        names += [f"add_rms_norm {dn}", f"rms_norm {dn}"]
        g = (torch.randn(2, 2 * 1100, generator=gen) * 3).to(dt)
        jobs.append(dict(kind="silu_mul", args=dict(gate_up=g)))
        refs.append(silu_mul_naive(g))
        names.append(f"silu_mul {dn}")
        for case, cid in zip(ROPE_CASES, ROPE_IDS):
            a, _ = rope_case(*case, dt, gen)
            wide = torch.cat([a["x"], torch.randn_like(a["x"][:, :3])], 1)
            strided = dict(a, x=wide[:, :a["x"].shape[1]])          # head stride > D rows
            rot_only = dict(a, n_rope=0, rot_a=None, rot_b=a["rot_b"] if a["rot_b"] is not None
                            else a["rot_a"])
            for variant, args in (("", a), (" strided", strided), (" rotation only", rot_only)):
                jobs.append(dict(kind="rope_rotate", args=args))
                refs.append(rope_rotate_naive(**args))
                names.append(f"rope_rotate {cid} {dn}{variant}")
    results = run_interpreted(jobs)
    for name, job, res, ref in zip(names, jobs, results, refs):
        out = res["out"]
        pairs = list(zip(out, ref)) if isinstance(ref, tuple) else [(out, ref)]
        for got, want in pairs:
            assert got.dtype == want.dtype and got.shape == want.shape, name
            err = rel_err(got, want)
            print(f"{name}: rel err {err:.2e}")
            assert err <= TOL[want.dtype], name


# ---- bad input ------------------------------------------------------------------------------
def test_row_ops_reject_inputs_that_do_not_fit():
    x = torch.randn(2, 6, 64)
    cos = torch.randn(2, 64)
    bad = [
        lambda: torch.ops.kvcompile.rms_norm(x, torch.ones(63), 1e-5),
        lambda: torch.ops.kvcompile.add_rms_norm(x, x[:1], torch.ones(64), 1e-5),
        lambda: torch.ops.kvcompile.rms_norm(x.long(), torch.ones(64), 1e-5),
        lambda: torch.ops.kvcompile.rope_rotate(x, cos, cos, False, 7, None, None),
        lambda: torch.ops.kvcompile.rope_rotate(x, cos[:1], cos[:1], False, 4, None, None),
        lambda: torch.ops.kvcompile.rope_rotate(x, cos, cos, False, 4, torch.eye(32), None),
        lambda: torch.ops.kvcompile.silu_mul(torch.randn(2, 7)),
    ]
    for call in bad:
        with pytest.raises(OpInputError) as e:
            call()
        assert isinstance(e.value, KvcompileError) and "got" in str(e.value)


# ---- GPU ------------------------------------------------------------------------------------
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_gpu_row_ops_match_references(dtype):
    """The ops on CUDA (compiled kernels) at a decode and a prefill width, 8B geometry."""
    gen = torch.Generator().manual_seed(fresh_seed())
    for rows in (1, 300):
        x, r, w = norm_case(dtype, gen, rows=rows, n=4096)
        s, y = torch.ops.kvcompile.add_rms_norm(x.cuda(), r.cuda(), w.cuda(), 1e-5)
        s0, y0 = rms_norm_naive(x, w, 1e-5, r)
        assert rel_err(s.cpu(), s0) <= TOL[dtype] and rel_err(y.cpu(), y0) <= TOL[dtype]
        g = torch.randn(rows, 2 * 14336, generator=gen).to(dtype)
        assert rel_err(torch.ops.kvcompile.silu_mul(g.cuda()).cpu(), silu_mul_naive(g)) \
            <= TOL[dtype]
        for case, cid in zip(ROPE_CASES, ROPE_IDS):
            a, _ = rope_case(*case, dtype, gen, rows=rows, hq=32, hk=8)
            got = torch.ops.kvcompile.rope_rotate(*[v.cuda() if torch.is_tensor(v) else v
                                                   for v in a.values()])
            err = rel_err(got.cpu(), rope_rotate_naive(**a))
            print(f"{cid} {dtype} rows {rows}: rel err {err:.2e}")
            assert err <= TOL[dtype], cid


@pytest.mark.gpu
@gpu
def test_gpu_row_ops_under_inductor():
    """lower="inductor" compiles these kernels itself (user-defined Triton kernels, float
    arguments as fp64 constants): bf16 rows through torch.compile(inductor) equal the ops
    run eagerly."""
    gen = torch.Generator().manual_seed(fresh_seed())
    x, r, w = (t.cuda() for t in norm_case(torch.bfloat16, gen, rows=2, n=4096))
    a, _ = rope_case(128, 128, False, "q8_0", "q4_0", torch.bfloat16, gen, rows=2)
    a = {k: v.cuda() if torch.is_tensor(v) else v for k, v in a.items()}
    g = torch.randn(2, 2 * 1024, generator=gen).to(torch.bfloat16).cuda()

    def rows(x, r, w, g, a):
        s, y = torch.ops.kvcompile.add_rms_norm(x, r, w, 1e-5)
        return (s, y, torch.ops.kvcompile.rms_norm(x, w, 1e-5), torch.ops.kvcompile.silu_mul(g),
                torch.ops.kvcompile.rope_rotate(*a.values()))
    torch._dynamo.reset()
    got = torch.compile(rows, backend="inductor", fullgraph=True)(x, r, w, g, a)
    want = rows(x, r, w, g, a)
    for i, (o, e) in enumerate(zip(got, want)):
        assert o.dtype == e.dtype and rel_err(o, e) <= TOL[torch.bfloat16], i
