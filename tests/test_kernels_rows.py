"""The row ops of a decoder layer (ops/rms_norm, ops/rope_rotate, ops/silu_mul): each
reference against an fp64 formula written here, each Triton kernel against its reference
(CPU: under TRITON_INTERPRET=1 in a child process, see kernel_oracle; GPU: compiled,
marked), with fresh random inputs. Kernels and references round the same fp32 value
(computed in another order) to the output dtype: f16 / bf16 outputs may differ by one unit in
the last place element by element (close_in_ulps), f32 ones by fp32 noise; the references
against fp64 by one rounding of the output dtype."""
from __future__ import annotations

import pytest
import torch

import kvcompile.ops  # noqa: F401
from kernel_oracle import fresh_seed, rel_err, run_interpreted
from kvcompile.errors import KvcompileError, OpInputError
from kvcompile.kv.rotation import k_rotation, v_rotation
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
# rotations on K only, V only, both, none; head dims that are not powers of two (padded
# tiles: 192 with rotations of 64-blocks, 80 without)
ROPE_CASES = [(128, 128, False, "q8_0", "q4_0"), (64, 32, True, "q4_0", "f16"),
              (256, 256, True, "bf16", "q8_0"), (128, 64, False, "f16", "f16"),
              (192, 64, True, "q8_0", "q4_0"), (80, 40, False, "f16", "f16")]
ROPE_IDS = [f"D{d}-R{r}-{'neox' if n else 'pairs'}-K{k}-V{v}" for d, r, n, k, v in ROPE_CASES]
MANTISSA = {torch.float16: 10, torch.bfloat16: 7}


def close_in_ulps(got, ref) -> float:
    """f16 / bf16: the largest |got - ref| in units in the last place of the dtype at ref,
    plus fp32 noise (2^-20 of the largest |ref|: sums of a few hundred fp32 terms); the
    check also asserts that at most 1% of the elements differ at all (same fp32 value,
    rounded alike: a truncating cast would change about half). f32: the max-norm relative
    error in units of TOL[f32]."""
    if ref.dtype not in MANTISSA:
        return rel_err(got, ref) / TOL[torch.float32]
    r, diff = ref.double(), (got.double() - ref.double()).abs()
    assert (diff > 0).double().mean().item() <= 0.01, "too many elements round differently"
    _, e = torch.frexp(r)
    ulp = torch.ldexp(torch.ones_like(r), e - 1 - MANTISSA[ref.dtype])
    tiny = 2.0 ** (-14 - MANTISSA[torch.float16]) if ref.dtype == torch.float16 else 2.0 ** -133
    noise = 2.0 ** -20 * r.abs().max().item()
    return (diff / (ulp.clamp_min(tiny) + noise)).max().item()


def norm_case(dtype, gen, rows=5, n=384):
    x = (torch.randn(rows, n, generator=gen) * 3).to(dtype)
    r = torch.randn(rows, n, generator=gen).to(dtype)
    w = torch.rand(n, generator=gen) + 0.5
    return x, r, w


def rope_case(head_dim, rot_dim, neox, k_name, v_name, dtype, gen, rows=3, hq=8, hk=2):
    """Arguments of rope_rotate for the q/k/v heads of one step (and the rope angles' cos /
    sin [T, R/2])."""
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
    r, neox = case[1], case[2]
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


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_every_kv_rotation_is_a_scaled_sign_matrix(head_dim):
    """What rope_rotate's kernel relies on: rot == rot[0, 0] * sign(rot), rot[0, 0] > 0."""
    for t in ("q8_0", "q4_0"):
        for rot in (k_rotation(F.kv_type(t), head_dim), v_rotation(F.kv_type(t), head_dim)):
            assert rot is not None and rot[0, 0] > 0
            assert torch.equal(rot, rot[0, 0] * rot.sign())


# ---- Triton kernels under the interpreter -------------------------------------------------
def test_row_kernels_interpreted_match_references():
    """Every dtype; rope cases with partial rotary, both layouts, every rotation mix, padded
    head dims, a strided input (head stride 2 D), the rotation alone (n_rope = 0) and rope
    alone; norms with and without the residual, a row width that is not a power of two.
    Within one unit in the last place of f16 / bf16 element by element."""
    gen = torch.Generator().manual_seed(fresh_seed())
    jobs, refs, names = [], [], []
    for dn, dt in DTYPES.items():
        x, r, w = norm_case(dt, gen)
        jobs += [dict(kind="rms_norm", args=dict(x=x, weight=w, eps=1e-6, residual=r)),
                 dict(kind="rms_norm", args=dict(x=x, weight=w, eps=1e-6))]
        refs += [rms_norm_naive(x, w, 1e-6, r), (None, rms_norm_naive(x, w, 1e-6)[1])]
        names += [f"add_rms_norm {dn}", f"rms_norm {dn}"]
        g = (torch.randn(2, 2 * 1100, generator=gen) * 3).to(dt)
        jobs.append(dict(kind="silu_mul", args=dict(gate_up=g)))
        refs.append(silu_mul_naive(g))
        names.append(f"silu_mul {dn}")
        for i, (case, cid) in enumerate(zip(ROPE_CASES, ROPE_IDS)):
            # the first case with an 8B-like 32 + 8 + 8 heads: several rope head blocks
            a, _ = rope_case(*case, dt, gen, **(dict(hq=32, hk=8) if i == 0 else {}))
            x = a["x"]
            wide = torch.cat([x, torch.randn_like(x)], -1)          # head stride 2 D
            strided = dict(a, x=wide[..., :x.shape[-1]])
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
            if want is None:            # rms_norm without a residual returns no sum
                assert got is None, name
                continue
            assert got.dtype == want.dtype and got.shape == want.shape, name
            err = close_in_ulps(got, want)
            print(f"{name}: {err:.2f} ulp" if want.dtype in MANTISSA else
                  f"{name}: rel err {err * TOL[torch.float32]:.2e}")
            assert err <= 1.0, name


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


def test_model_entry_points_equal_the_ops_on_the_cpu():
    """ops/rows (what the models call): on the CPU the reference itself, bit for bit the
    ops' CPU results, and the same argument checks."""
    from kvcompile.ops import rows
    gen = torch.Generator().manual_seed(fresh_seed())
    x, r, w = norm_case(torch.bfloat16, gen)
    a, _ = rope_case(*ROPE_CASES[0], torch.bfloat16, gen)
    g = torch.randn(3, 64, generator=gen).bfloat16()
    pairs = [(rows.rms_norm(x, w, 1e-5), torch.ops.kvcompile.rms_norm(x, w, 1e-5)),
             *zip(rows.add_rms_norm(x, r, w, 1e-5),
                  torch.ops.kvcompile.add_rms_norm(x, r, w, 1e-5)),
             (rows.rope_rotate(*a.values()), torch.ops.kvcompile.rope_rotate(*a.values())),
             (rows.silu_mul(g), torch.ops.kvcompile.silu_mul(g))]
    for got, want in pairs:
        assert torch.equal(got, want)
    with pytest.raises(OpInputError):
        rows.add_rms_norm(x, r[:1], w, 1e-5)
    with pytest.raises(OpInputError):
        rows.rope_rotate(a["x"], a["cos"], a["sin"], False, 99, None, None)
    with pytest.raises(OpInputError):
        rows.silu_mul(torch.randn(2, 7))


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
        assert close_in_ulps(s.cpu(), s0) <= 1 and close_in_ulps(y.cpu(), y0) <= 1
        g = torch.randn(rows, 2 * 14336, generator=gen).to(dtype)
        assert close_in_ulps(torch.ops.kvcompile.silu_mul(g.cuda()).cpu(), silu_mul_naive(g)) <= 1
        for case, cid in zip(ROPE_CASES, ROPE_IDS):
            a, _ = rope_case(*case, dtype, gen, rows=rows, hq=32, hk=8)
            got = torch.ops.kvcompile.rope_rotate(*[v.cuda() if torch.is_tensor(v) else v
                                                   for v in a.values()])
            err = close_in_ulps(got.cpu(), rope_rotate_naive(**a))
            print(f"{cid} {dtype} rows {rows}: {err:.2f} (ulp, or f32 tolerances)")
            assert err <= 1, cid


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
        assert o.dtype == e.dtype and close_in_ulps(o, e) <= 1, i
