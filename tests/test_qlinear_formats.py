"""GGUF weight formats: the planar layout (ops/qlinear/formats.py), its fp32 reference
dequantizer (ops/qlinear/naive.py) against the gguf package bit for bit, and our torch
quantizer (kvcompile/io/gguf/quantize.py): valid bytes, error near llama.cpp's, bad input, the
same bytes on CPU and CUDA, and a synthetic q4_k model that llama.cpp reads as we do."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kernel_oracle import fresh_seed
from kvcompile.errors import UnsupportedModelError
from kvcompile.io.gguf.quantize import quantizable_types, quantize
from kvcompile.ops.qlinear.formats import FORMATS, ROW_ALIGN, from_planar, to_planar
from kvcompile.ops.qlinear.naive import dequantize_planar, dequantize_rows, qlinear_naive

TYPES = list(FORMATS)
# relative RMS error bounds on Gaussian rows, a little above ours as measured (64 x 2048,
# 2026-05); llama.cpp's own quantizer (llama_model_quantize, --pure, no imatrix) measured on
# a synthetic model's Gaussian weights in brackets
MAX_REL_ERR = {
    "F16": 3e-4, "BF16": 2e-3,
    "Q8_0": 0.0055,   # ours 0.0052 (llama.cpp 0.0053)
    "Q4_0": 0.084,    # 0.081  (0.086)
    "Q4_1": 0.074,    # 0.0713 (0.078)
    "Q5_0": 0.042,    # 0.0403 (0.043)
    "Q5_1": 0.036,    # 0.0345 (0.038)
    "Q2_K": 0.272,    # 0.263  (0.296)
    "Q3_K": 0.149,    # 0.1436 (0.151)
    "Q4_K": 0.074,    # 0.0712 (0.0714)
    "Q5_K": 0.037,    # 0.0351 (0.0361)
    "Q6_K": 0.0175,   # 0.0167 (0.0177)
    "IQ4_NL": 0.0765,  # 0.0734 (0.0761)
    "IQ4_XS": 0.0775,  # 0.0741 (0.0767)
}


def shapes(name):
    """(N, K) cases: odd row counts, odd and even block counts."""
    block = FORMATS[name].block
    if block == 1:
        return [(5, 96), (3, 64)]
    return [(5, 3 * block), (3, 2 * block)]


def gguf_dequant(raw: torch.Tensor, name: str, k: int) -> torch.Tensor:
    out = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[name])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(-1, k)


def random_rows(name: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Uniform random GGUF bytes, every code and scale bit pattern, with the fp16 scale
    fields set to finite values (d, dmin positive, Q4_1 / Q5_1's min m either sign) and
    F16 / BF16 values kept finite (a NaN compares unequal to itself)."""
    f = FORMATS[name]
    raw = torch.randint(0, 256, (n, f.row_bytes(k)), dtype=torch.uint8, generator=gen)
    if f.block == 1:   # exponent all ones (inf / NaN): clear its top bit
        u, exp = raw.view(torch.int16), 0x7C00 if name == "F16" else 0x7F80
        u ^= torch.where((u & exp) == exp, 0x4000, 0).to(torch.int16)
        return raw
    blocks = raw.view(n, -1, f.block_bytes)
    at = 0
    for field, size in f.fields:
        if field in ("d", "dmin", "m"):
            v = torch.rand(blocks.shape[:2], generator=gen) * 2 + 0.01
            if field == "m":
                v = torch.where(torch.rand(v.shape, generator=gen) < 0.5, -v, v)
            blocks[:, :, at:at + 2] = v.half().view(torch.uint8).view(n, -1, 2)
        at += size
    return raw


def gaussian(n, k, gen, scale=1.0):
    return torch.randn(n, k, generator=gen) * scale


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(fresh_seed())


def cases():
    return [pytest.param(name, n, k, id=f"{name}-{n}x{k}") for name in TYPES
            for n, k in shapes(name)]


@pytest.mark.parametrize("name,n,k", cases())
def test_planar_round_trip_and_padding(name, n, k, gen):
    f = FORMATS[name]
    raw = random_rows(name, n, k, gen)
    planar = to_planar(raw, name, k)
    data = f.blocks_per_row(k) * f.planar_block_bytes     # the GGUF bytes, scales unpacked
    extra = 4 * f.blocks_per_row(k) if name in ("Q4_K", "Q5_K") else 0
    assert data == f.row_bytes(k) + extra
    assert planar.shape == (n, -(-data // ROW_ALIGN) * ROW_ALIGN)
    assert planar.shape[1] % ROW_ALIGN == 0 and planar.shape[1] - data < ROW_ALIGN
    assert not planar[:, data:].any()
    assert torch.equal(from_planar(planar, name, k), raw)


def test_k_scales_unpack_to_bytes_and_back(gen):
    """Q4_K / Q5_K's packed 6-bit scales and mins: every 12-byte pattern unpacks to 16
    values below 64 that pack back to it, sub-blocks 0-3 straight from bytes 0-7."""
    from kvcompile.ops.qlinear.formats import pack_k_scales, unpack_k_scales
    s = torch.randint(0, 256, (4096, 12), dtype=torch.uint8, generator=gen)
    u = unpack_k_scales(s)
    assert u.shape == (4096, 16) and int(u.max()) < 64
    assert torch.equal(u[:, 0:4], s[:, 0:4] & 63) and torch.equal(u[:, 8:12], s[:, 4:8] & 63)
    assert torch.equal(pack_k_scales(u), s)


@pytest.mark.parametrize("name,n,k", cases())
def test_dequantize_equals_gguf_package(name, n, k, gen):
    """Bit for bit, on our quantizer's bytes and on random bytes."""
    for source, raw in (("quantized", quantize(gaussian(n, k, gen), name)),
                        ("random", random_rows(name, n, k, gen))):
        ref = gguf_dequant(raw, name, k)
        got = dequantize_planar(to_planar(raw, name, k), name, k)
        assert got.dtype == torch.float32 and got.shape == (n, k)
        bad = (got != ref).sum().item()
        assert bad == 0, f"{name} {source}: {bad} of {n * k} values differ, max " \
                         f"{(got - ref).abs().max().item():.3g}"


def test_rows_and_linear_reference(gen):
    n, k = 7, 512
    raw = quantize(gaussian(n, k, gen), "Q4_K")
    planar = to_planar(raw, "Q4_K", k)
    w = gguf_dequant(raw, "Q4_K", k)
    rows = torch.tensor([6, 0, 3, 3])
    assert torch.equal(dequantize_rows(planar, rows, "Q4_K", k), w[rows])
    x, bias = gaussian(3, k, gen).bfloat16(), gaussian(1, n, gen)[0]
    got = qlinear_naive(x, planar, "Q4_K", k, bias)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (x.float() @ w.t() + bias).bfloat16())
    assert torch.equal(qlinear_naive(x.float(), planar, 12, k), x.float() @ w.t())


@pytest.mark.parametrize("name", TYPES)
def test_quantizer_error(name, gen):
    """Relative RMS error on Gaussian rows, at unit scale and at a weight-like scale (fp16
    scales near the subnormals); re-quantizing the dequantized values adds little."""
    assert sorted(quantizable_types()) == sorted(TYPES)
    x = gaussian(16, 2048, gen)
    errs = []
    for scale in (1.0, 0.01):
        raw = quantize(x * scale, name)
        assert raw.dtype == torch.uint8 and raw.shape == (16, FORMATS[name].row_bytes(2048))
        y = gguf_dequant(raw, name, 2048)
        assert torch.isfinite(y).all()
        errs.append(((y - x * scale).norm() / (x * scale).norm()).item())
        again = gguf_dequant(quantize(y, name), name, 2048)
        errs.append(((again - y).norm() / y.norm()).item())
    print(f"{name}: rel err {errs[0]:.4f} (x0.01: {errs[2]:.4f}), re-quantized "
          f"{errs[1]:.4f} / {errs[3]:.4f}")
    assert max(errs[0], errs[2]) <= MAX_REL_ERR[name]
    assert max(errs[1], errs[3]) <= 0.5 * MAX_REL_ERR[name]


@pytest.mark.parametrize("name", ["F16", "BF16"])
def test_float_types_round_to_nearest_even(name, gen):
    x = gaussian(4, 64, gen) * torch.logspace(-6, 4, 64)
    ref = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType[name])
    assert np.array_equal(quantize(x, name).numpy(), np.asarray(ref).view(np.uint8).reshape(4, -1))


def test_scales_stay_in_range_on_hard_rows(gen):
    """Zero, constant, one-outlier, tiny and huge rows: finite fp16 scales, valid bytes."""
    k = 256
    rows = torch.stack([torch.zeros(k), torch.full((k,), 0.3), -torch.full((k,), 2.0),
                        torch.nn.functional.one_hot(torch.tensor(7), k).float() * 50,
                        gaussian(1, k, gen)[0] * 1e-7, gaussian(1, k, gen)[0] * 1e8])
    for name in TYPES:
        # the float types keep the huge row's overflow (inf); scales must never overflow
        x = rows[:-1] if FORMATS[name].block == 1 else rows
        y = gguf_dequant(quantize(x, name), name, k)
        assert torch.isfinite(y).all(), name
        assert (y[0] == 0).all(), name
        # a constant row comes back close (it is all one level of every format)
        assert ((y[1] - 0.3).abs() <= 0.01).all() and ((y[2] + 2).abs() <= 0.01).all(), name
        assert (y[3, 7] - 50).abs() <= 0.5 and (y[3].abs() <= 50.5).all(), name


def test_bytes_do_not_depend_on_search_batching(gen, monkeypatch):
    import kvcompile.io.gguf.scale_fit as q
    x = gaussian(6, 512, gen)
    together = {name: quantize(x, name) for name in TYPES}
    monkeypatch.setattr(q, "SEARCH_ELEMENTS", 1)     # one candidate at a time
    for name in TYPES:
        assert torch.equal(quantize(x, name), together[name]), name


def test_bad_input_says_what_to_change():
    with pytest.raises(UnsupportedModelError, match="pick one of.*Q4_K"):
        quantize(torch.zeros(2, 256), "IQ2_XXS")
    with pytest.raises(UnsupportedModelError, match="multiple of 256"):
        quantize(torch.zeros(2, 288), "q4_k")
    with pytest.raises(UnsupportedModelError, match="multiple of 32"):
        quantize(torch.zeros(2, 48), "Q8_0")
    with pytest.raises(UnsupportedModelError, match=r"\[rows, K\]"):
        quantize(torch.zeros(256), "Q8_0")
    with pytest.raises(UnsupportedModelError, match="NaN or infinity"):
        quantize(torch.tensor([[float("nan")] * 32]), "Q4_0")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_same_bytes_on_cpu_and_cuda(gen):
    x = torch.cat([gaussian(64, 1024, gen), gaussian(64, 1024, gen) * 0.01])
    for name in TYPES:
        cpu, cuda = quantize(x, name), quantize(x.cuda(), name).cpu()
        assert torch.equal(cpu, cuda), f"{name}: {(cpu != cuda).sum().item()} bytes differ"
        planar = to_planar(cpu, name, 1024)
        assert torch.equal(dequantize_planar(planar.cuda(), name, 1024).cpu(),
                           dequantize_planar(planar, name, 1024)), name


def test_synthetic_q4_k_model_matches_llama_cpp(tmp_path):
    pytest.importorskip("llama_cpp")
    from kvcompile.kv.store import KvStore
    from kvcompile.io.make_model import make_model
    from kvcompile.models.llama import LlamaModel
    from kvcompile.io.weights import load_weights
    from llama_oracle import agreement, decisive_agreement, llama_cpp, llama_cpp_logits
    path = tmp_path / "tiny.q4_k.gguf"
    make_model("llama", "tiny", path, weight_type="q4_k", seed=fresh_seed() % 1000,
               n_layers=2, vocab_size=2048, logit_gain=4.0)   # peaky: decisive top-1s
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.0.ffn_down.weight"] == "Q4_K" and types["token_embd.weight"] == "Q4_K"
    n = 160            # rows enough that a random model leads by >= 1 logit in 16 of them
    tokens = torch.randint(300, 2048, (n,), generator=torch.Generator().manual_seed(1))
    ref = llama_cpp_logits(llama_cpp(path, n_ctx=256), tokens.tolist())
    w = load_weights(path, progress=False)
    model = LlamaModel.from_weights(w.config, w.tensors, dtype=torch.float32, device="cpu")
    with torch.inference_mode():
        ours = model(tokens, torch.arange(n), KvStore(w.config, max_tokens=n))
    top1, kl, kl_max = agreement(ours, ref)
    sure, n_sure = decisive_agreement(ours, ref, 1.0)
    # llama.cpp quantizes the activations (Q8_K) inside its Q4_K matmuls; we do not
    print(f"q4_k synthetic: top-1 {top1:.3f} ({sure:.3f} of {n_sure} rows led by >= 1), "
          f"KL mean {kl:.2e} max {kl_max:.2e}")
    assert torch.isfinite(ref).all() and n_sure >= 16 and sure == 1.0 and kl < 0.02
