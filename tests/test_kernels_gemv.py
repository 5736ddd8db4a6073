"""ops/gemv (the decode GEMV): its reference and its Triton kernels (CPU: under
TRITON_INTERPRET=1 in a child process; GPU: compiled, marked) against an fp64 product, with
fresh random inputs. Bound, element by element: one unit in the last place of the output
dtype (the final rounding) plus 2^-20 of sum_k |x_k w_k| (fp32 accumulation in any order,
far above its real error and far below one wrong or missing term)."""
from __future__ import annotations

import pytest
import torch

import kvcompile.ops  # noqa: F401
from kernel_oracle import fresh_seed, run_interpreted
from kvcompile.errors import KvcompileError, OpInputError
from kvcompile.ops.gemv.naive import gemv_naive

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MANTISSA = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}


def gemv_case(m, n, k, dtype, gen, bias=False):
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, b


def excess_over_bound(got, x, w, b) -> float:
    """max |got - fp64| / (1 ulp of the output dtype at fp64 + 2^-20 sum |x w|): <= 1 holds."""
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    mag = x.double().abs() @ w.double().abs().t() + (0 if b is None else b.double().abs())
    _, e = torch.frexp(ref)
    ulp = torch.ldexp(torch.ones_like(ref), e - 1 - MANTISSA[got.dtype])
    return ((got.double().cpu() - ref).abs() / (ulp + 2.0 ** -20 * mag)).max().item()


@pytest.mark.parametrize("dtype", [*DTYPES.values(), torch.float32], ids=[*DTYPES, "f32"])
def test_gemv_reference_within_one_rounding_of_fp64(dtype):
    gen = torch.Generator().manual_seed(fresh_seed())
    x, w, b = gemv_case(3, 200, 300, dtype, gen, bias=True)
    y = gemv_naive(x, w, b)
    assert y.dtype == dtype and y.shape == (3, 200)
    assert excess_over_bound(y, x, w, b) <= 1.0


def test_gemv_kernels_interpreted_match_fp64():
    """Both kernels (one row: CUDA-core FMAs; 2..8 rows: tensor-core dots), both dtypes,
    with and without bias, tile-aligned shapes and shapes whose N and K leave partial tiles,
    and a strided x (rows 2 K apart)."""
    gen = torch.Generator().manual_seed(fresh_seed())
    cases = [  # (m, n, k, bias, config)
        (1, 64, 128, False, dict(BLOCK_N=4, BLOCK_K=64, num_warps=4)),
        (1, 40, 100, True, dict(BLOCK_N=16, BLOCK_K=32, num_warps=4)),
        (3, 48, 80, True, dict(BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2)),
        (8, 64, 96, False, dict(BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)),
        (2, 20, 64, False, None),
        (1, 24, 200, True, None)]   # one row, the launch defaults: a K tile past K, masked
    jobs, args, names = [], [], []
    for dn, dt in DTYPES.items():
        for m, n, k, bias, cfg in cases:
            x, w, b = gemv_case(m, n, k, dt, gen, bias)
            if m == 2:
                x = torch.cat([x, torch.randn_like(x)], 1)[:, :k]     # row stride 2 k
            jobs.append(dict(kind="gemv", args=dict(x=x, weight=w, bias=b, config=cfg)))
            args.append((x, w, b))
            names.append(f"{dn} m{m} n{n} k{k}{' bias' if bias else ''}")
    for name, res, (x, w, b) in zip(names, run_interpreted(jobs), args):
        got = res["out"]
        assert got.dtype == x.dtype and got.shape == (x.shape[0], w.shape[0]), name
        err = excess_over_bound(got, x, w, b)
        print(f"{name}: {err:.2f} of the bound")
        assert err <= 1.0, name


def test_gemv_silu_mul_interpreted_is_silu_mul_of_the_gemv():
    """silu_mul=True (the SwiGLU gate/up GEMV): both kernels, partial tiles and a bias;
    the result is silu_mul's formula on the plain GEMV's rounded output (within one unit in
    the last place: exp differs between the interpreter and torch), the plain GEMV within
    its fp64 bound."""
    from kvcompile.ops.silu_mul.naive import silu_mul_naive
    gen = torch.Generator().manual_seed(fresh_seed())
    cases = [(1, 64, 128, False, dict(BLOCK_N=16, BLOCK_K=64, num_warps=4)),
             (1, 40, 100, True, dict(BLOCK_N=16, BLOCK_K=32, num_warps=4)),
             (5, 96, 80, True, dict(BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2))]
    jobs, args = [], []
    for dn, dt in DTYPES.items():
        for m, n, k, bias, cfg in cases:
            x, w, b = gemv_case(m, n, k, dt, gen, bias)
            for silu in (False, True):
                jobs.append(dict(kind="gemv", args=dict(x=x, weight=w, bias=b, config=cfg,
                                                        silu_mul=silu)))
            args.append((f"{dn} m{m} n{n} k{k}", x, w, b))
    res = run_interpreted(jobs)
    for i, (name, x, w, b) in enumerate(args):
        y, z = res[2 * i]["out"], res[2 * i + 1]["out"]
        assert excess_over_bound(y, x, w, b) <= 1.0, name
        assert z.shape == (x.shape[0], w.shape[0] // 2) and z.dtype == x.dtype, name
        want = silu_mul_naive(y)
        ulp = 2.0 ** -MANTISSA[z.dtype] * want.float().abs().clamp_min(2.0 ** -14)
        diff = ((z.float() - want.float()).abs() / ulp).max().item()
        print(f"{name}: silu_mul within {diff:.2f} ulp of silu_mul(gemv)")
        assert diff <= 2.0, name


def test_gemv_rejects_inputs_it_does_not_take():
    x = torch.randn(2, 64).bfloat16()
    w = torch.randn(32, 64).bfloat16()
    bad = [lambda: torch.ops.kvcompile.gemv(torch.randn(9, 64).bfloat16(), w, None),
           lambda: torch.ops.kvcompile.gemv(x, w[:, :63], None),
           lambda: torch.ops.kvcompile.gemv(x.float(), w.float(), None),
           lambda: torch.ops.kvcompile.gemv(x, w.half(), None),
           lambda: torch.ops.kvcompile.gemv(x, w, torch.ones(31).bfloat16()),
           lambda: torch.ops.kvcompile.gemv(x, w[:31], None, True)]     # odd gate/up
    for call in bad:
        with pytest.raises(OpInputError) as e:
            call()
        assert isinstance(e.value, KvcompileError) and "got" in str(e.value)


def test_model_linear_takes_f_linear_off_cuda_and_past_eight_rows():
    """ops/rows.linear (what the models' Linear calls): F.linear on the CPU, bit for bit."""
    from kvcompile.models.layers import Linear
    gen = torch.Generator().manual_seed(fresh_seed())
    lin = Linear(64, 48, bias=True).bfloat16()
    for m in (1, 12):
        x = torch.randn(m, 64, generator=gen).bfloat16()
        assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))


# ---- GPU ------------------------------------------------------------------------------------
SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
             "down": (4096, 14336), "smollm2_gate_up": (3072, 576)}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES_8B.values(), ids=SHAPES_8B.keys())
def test_gpu_gemv_matches_fp64(shape, dtype):
    """The launch defaults on the 8B decode shapes (and a 576-wide one: partial K tiles), 1,
    2, 5 and 8 rows, bias on the odd widths; repeated calls give the same bits."""
    n, k = shape
    gen = torch.Generator().manual_seed(fresh_seed())
    for m in (1, 2, 5, 8):
        x, w, b = gemv_case(m, n, k, dtype, gen, bias=m % 2 == 1)
        xc, wc, bc = x.cuda(), w.cuda(), None if b is None else b.cuda()
        got = torch.ops.kvcompile.gemv(xc, wc, bc)
        assert torch.equal(got, torch.ops.kvcompile.gemv(xc, wc, bc))
        err = excess_over_bound(got, x, w, b)
        print(f"{n}x{k} {dtype} m{m}: {err:.2f} of the bound")
        assert err <= 1.0
        # the SwiGLU form: silu_mul in the epilogue, the same bits as the two kernels
        fused = torch.ops.kvcompile.gemv(xc, wc, bc, True)
        assert torch.equal(fused, torch.ops.kvcompile.silu_mul(got)), f"silu_mul m{m}"


@pytest.mark.gpu
@gpu
def test_gpu_model_linear_routes_decode_rows_to_gemv():
    """The models' Linear on CUDA: the gemv op for 1..8 f16 / bf16 rows (same bits),
    F.linear for 9 rows, fp32 and 3-D inputs."""
    from kvcompile.models.layers import Linear
    gen = torch.Generator().manual_seed(fresh_seed())
    lin = Linear(512, 384, bias=True).cuda()
    lin16 = Linear(512, 384, bias=True).cuda().bfloat16()
    for m in (1, 3, 8, 9):
        x = torch.randn(m, 512, generator=gen).cuda()
        x16 = x.bfloat16()
        want = (torch.ops.kvcompile.gemv(x16, lin16.weight, lin16.bias) if m <= 8 else
                torch.nn.functional.linear(x16, lin16.weight, lin16.bias))
        assert torch.equal(lin16(x16), want), m
        assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias)), m
    x3 = torch.randn(1, 2, 512, generator=gen).cuda().bfloat16()
    assert torch.equal(lin16(x3), torch.nn.functional.linear(x3, lin16.weight, lin16.bias))


@pytest.mark.gpu
@gpu
def test_gpu_gemv_under_torch_compile_equals_eager():
    """torch.compile (inductor) sees the kernels through triton_op: same bits as eager."""
    gen = torch.Generator().manual_seed(fresh_seed())
    x, w, b = (t.cuda() for t in gemv_case(4, 1024, 512, torch.bfloat16, gen, bias=True))
    x1 = x[:1].contiguous()

    def f(x, x1, w, b):
        return torch.ops.kvcompile.gemv(x, w, b), torch.ops.kvcompile.gemv(x1, w, None)
    torch._dynamo.reset()
    got = torch.compile(f, backend="inductor", fullgraph=True)(x, x1, w, b)
    for o, e in zip(got, f(x, x1, w, b)):
        assert torch.equal(o, e)
