"""ops/qlinear (matmuls over GGUF block-format weights): the Triton kernels against fp32
products of the `gguf` package's dequantization of the same bytes, for every type with a
kernel. CPU: under TRITON_INTERPRET=1 in a child process, small shapes; GPU (marked): the
acceptance shapes, GEMV at 1/2/4/8 rows and GEMM at 512, N and K off the tiles.

The weights' bytes are random (every code and scale bit pattern), with finite fp16 scales
of a realistic size, or the `gguf` package's own quantization of random values where it
has one. Error measure: max |y - ref| / max |ref| (ref: fp32 x @ dequant(W)^T with x the
same bf16 activations); the bound 1e-2 covers the bf16 output rounding (2^-9) and the
weight tile's bf16 rounding in the tensor-core paths. The fused SwiGLU GEMV rounds gate and
up to bf16 before silu(gate) * up (as ops/silu_mul reads them) and rounds the product: three
roundings, bound 2e-2.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import kvcompile.ops  # noqa: F401
from kernel_oracle import fresh_seed, run_interpreted
from kvcompile.errors import KvcompileError, OpInputError, UnsupportedModelError
from kvcompile.ops.qlinear.formats import FORMATS, to_planar, weight_format

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TYPES = list(FORMATS)
BOUND = 1e-2
SILU_BOUND = 2e-2
_GGUF_QUANTIZES = ("BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def gguf_rows(name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid GGUF bytes of an [n, k] weight of type `name`: uint8 [n, row_bytes]."""
    f = weight_format(name)
    if name == "F16":
        return (rng.standard_normal((n, k)) * 0.05).astype(np.float16).view(np.uint8)
    if name in _GGUF_QUANTIZES:
        x = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        return gguf.quants.quantize(x, gguf.GGMLQuantizationType[name]).view(np.uint8)
    nb = k // f.block
    raw = rng.integers(0, 256, (n, nb, f.block_bytes), dtype=np.uint8)
    at = 0
    for field, size in f.fields:                    # finite fp16 scales of realistic size
        if field in ("d", "dmin"):
            d = (rng.random((n, nb)) * 2e-3 + 1e-4).astype(np.float16)
            raw[:, :, at:at + 2] = d.view(np.uint8).reshape(n, nb, 2)
        at += size
    return raw.reshape(n, nb * f.block_bytes)


def reference(name: str, raw: np.ndarray, k: int) -> torch.Tensor:
    qtype = gguf.GGMLQuantizationType[name]
    if name == "F16":
        return torch.from_numpy(raw.view(np.float16).astype(np.float32))
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32)).view(-1, k)


def case(name: str, n: int, k: int, rng) -> tuple[torch.Tensor, torch.Tensor]:
    raw = gguf_rows(name, n, k, rng)
    planar = to_planar(torch.from_numpy(np.ascontiguousarray(raw)), name, k)
    return planar, reference(name, raw, k)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float().cpu() - ref).abs().max() / ref.abs().max()).item()


def small_k(name: str) -> int:
    """Off the 256-value tiles: 2 x 256 + 3 blocks (F16/BF16: 200 values)."""
    block = weight_format(name).block
    return 200 if block == 1 else 512 + 3 * block if block == 32 else 5 * 256


# the README's test command checks the types people download most and the seed's file type;
# -m slow (CI) and ./dev test-triton-latest check every type
COMMON_TYPES = ("Q4_K", "Q6_K", "Q8_0", "IQ4_XS")


@pytest.mark.parametrize("types", [
    pytest.param(COMMON_TYPES, id="common-types"),
    pytest.param(tuple(TYPES), id="every-type", marks=pytest.mark.slow)])
def test_kernels_interpreted_match_gguf_dequantized_products(types):
    """Each type: one row (FMAs), 3 rows (tensor-core GEMV), 20 rows (GEMM), 70 rows
    (prefill: dequantized in chunks of 16 rows, then a dense product), the fused SwiGLU GEMV
    at 1 and 3 rows, and the embedding rows (dequantized exactly), N = 38 (off every row
    tile) and K off the 256-value tiles."""
    from kvcompile.ops.silu_mul.naive import silu_mul_naive
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    jobs, refs = [], []
    for name in types:
        k = small_k(name)
        w, deq = case(name, 38, k, rng)
        for m in (1, 3, 20):
            x = torch.randn(m, k, generator=gen).bfloat16()
            jobs.append(dict(kind="qlinear", args=dict(x=x, weight=w, type_name=name, k=k)))
            refs.append((f"{name} m{m}", "linear", x.float() @ deq.t()))
        for m in (1, 3):
            x = torch.randn(m, k, generator=gen).bfloat16()
            jobs.append(dict(kind="qlinear", args=dict(x=x, weight=w, type_name=name, k=k,
                                                       silu_mul=True)))
            refs.append((f"{name} m{m} silu", "silu", silu_mul_naive(x.float() @ deq.t())))
        x = torch.randn(70, k, generator=gen).bfloat16()
        jobs.append(dict(kind="qlinear_dense", args=dict(x=x, weight=w, type_name=name, k=k,
                                                         chunk_bytes=16 * k * 2)))
        refs.append((f"{name} m70 dense", "linear", x.float() @ deq.t()))
        rows = torch.tensor([37, 0, 5, 37])
        jobs.append(dict(kind="qembedding", args=dict(weight=w, type_name=name, k=k, rows=rows,
                                                      dtype=torch.float32)))
        refs.append((f"{name} rows", "rows", deq[rows]))
    worst = {}
    for (label, kind, ref), res in zip(refs, run_interpreted(jobs)):
        got = res["out"]
        assert got.shape == ref.shape, label
        if kind == "rows":
            assert torch.equal(got, ref), f"{label}: dequantized rows differ from gguf's"
            continue
        err = rel_err(got, ref)
        if kind == "silu":
            assert err <= SILU_BOUND, f"{label}: relative error {err:.2e}"
            continue
        worst[label.split()[0]] = max(worst.get(label.split()[0], 0.0), err)
        assert err <= BOUND, f"{label}: relative error {err:.2e}"
    print("max relative error by type:", {t: f"{e:.1e}" for t, e in worst.items()})


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", TYPES)
def test_kernels_on_gpu_match_gguf_dequantized_products(name):
    """The acceptance shapes: N = 4096 + 37 rows, K = 4096 + one block (F16/BF16: 4096 +
    40), GEMV at 1, 2, 4, 8 rows and GEMM at 512, bf16 activations."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    block = weight_format(name).block
    k = 4096 + (40 if block == 1 else block)
    w, deq = case(name, 4096 + 37, k, rng)
    w, deq_d = w.cuda(), deq.cuda()
    worst = 0.0
    for m in (1, 2, 4, 8, 512):
        x = torch.randn(m, k, generator=gen).bfloat16().cuda()
        y = torch.ops.kvcompile.qlinear(x, w, weight_format(name).ggml_id, k)
        err = rel_err(y, (x.float() @ deq_d.t()).cpu())
        print(f"{name} m{m}: relative error {err:.2e}")
        worst = max(worst, err)
        assert err <= BOUND, f"{name} m{m}: {err:.2e}"
    x = torch.randn(4, k, generator=gen).bfloat16().cuda()
    z = torch.ops.kvcompile.qlinear(x, w[:4096], weight_format(name).ggml_id, k, None, True)
    from kvcompile.ops.silu_mul.naive import silu_mul_naive
    assert rel_err(z, silu_mul_naive(x.float() @ deq_d[:4096].t()).cpu()) <= SILU_BOUND
    rows = torch.randint(0, w.shape[0], (7,), generator=gen).cuda()
    emb = torch.ops.kvcompile.qembedding(w, weight_format(name).ggml_id, k, rows, torch.float32)
    assert torch.equal(emb.cpu(), deq[rows.cpu()]), f"{name}: embedding rows"
    print(f"{name}: max relative error {worst:.2e}")


def test_qlinear_reference_on_the_cpu_is_the_dequantized_product():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    w, deq = case("Q4_K", 9, 512, rng)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(seed))
    y = torch.ops.kvcompile.qlinear(x, w, 12, 512)
    torch.testing.assert_close(y, x @ deq.t(), rtol=1e-5, atol=1e-5)


def test_qlinear_rejects_inputs_it_does_not_take():
    rng = np.random.default_rng(fresh_seed())
    w, _ = case("Q8_0", 8, 64, rng)
    x = torch.randn(2, 64)
    bad = [lambda: torch.ops.kvcompile.qlinear(x, w, 8, 96),            # K and rows disagree
           lambda: torch.ops.kvcompile.qlinear(x[:, :32], w, 8, 64),    # x of the wrong width
           lambda: torch.ops.kvcompile.qlinear(x, w.float(), 8, 64),    # not bytes
           lambda: torch.ops.kvcompile.qlinear(x, w, 8, 64, torch.ones(7)),
           lambda: torch.ops.kvcompile.qlinear(x, w[:7], 8, 64, None, True),
           lambda: torch.ops.kvcompile.qlinear(x.long(), w, 8, 64)]
    for call in bad:
        with pytest.raises(OpInputError) as e:
            call()
        assert isinstance(e.value, KvcompileError) and "got" in str(e.value)
    with pytest.raises(UnsupportedModelError, match="no quantized-linear kernel"):
        torch.ops.kvcompile.qlinear(x, w, 16, 64)                       # IQ2_XXS: no kernel
