"""Rope in both layouts (and partial rotary dims) against rotation by complex numbers in
float64; RMSNorm against its formula in float64. (llama.cpp refuses a llama file whose rope
covers only part of the head, so partial rope is checked here instead.)"""
from __future__ import annotations

import os

import pytest
import torch

from kvcompile.models.layers import RMSNorm, apply_rope_rows, rope_rows, rope_tables


def apply_rope(x, cos, sin, neox):
    """Rope from the half tables [T, R/2] as the models apply it: rows built, then applied."""
    return apply_rope_rows(x, *rope_rows(cos, sin, neox), neox)


def complex_rope(x: torch.Tensor, pos: torch.Tensor, rot: int, theta: float, neox: bool):
    """x [T, H, D] float64: pair i of the rotated dims turns by pos * theta^(-2i/rot)."""
    x = x.double()
    freqs = theta ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    turn = torch.polar(torch.ones(len(pos), rot // 2, dtype=torch.float64),
                       pos.double()[:, None] * freqs)[:, None, :]
    if neox:
        z = torch.complex(x[..., : rot // 2], x[..., rot // 2: rot]) * turn
        rotated = torch.cat([z.real, z.imag], dim=-1)
    else:
        z = torch.complex(x[..., 0:rot:2], x[..., 1:rot:2]) * turn
        rotated = torch.stack([z.real, z.imag], dim=-1).flatten(-2)
    return torch.cat([rotated, x[..., rot:]], dim=-1)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("rot", [64, 32])
def test_rope_matches_complex_rotation(neox, rot):
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    theta, max_pos = 100000.0, 5000
    x = torch.randn(7, 3, 64, generator=g)
    pos = torch.randint(0, max_pos, (7,), generator=g)
    cos, sin = rope_tables(rot, max_pos, theta)
    ours = apply_rope(x, cos[pos], sin[pos], neox)
    ref = complex_rope(x, pos, rot, theta, neox)
    err = (ours.double() - ref).abs().max().item()
    print(f"rope neox={neox} rotary dims {rot}/64 (seed {seed}): max error {err:.2e}")
    assert err < 1e-5
    assert torch.equal(ours[..., rot:], x[..., rot:])


def pairwise_rope(x, cos, sin, neox):
    """Rope as written pair by pair in f32: (a*c - b*s, a*s + b*c) for each rotated pair."""
    rot = cos.shape[-1] * 2
    xr, c, s = x[..., :rot].float(), cos[:, None, :], sin[:, None, :]
    if neox:
        a, b = xr[..., :rot // 2], xr[..., rot // 2:]
        out = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    else:
        a, b = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    return torch.cat([out.to(x.dtype), x[..., rot:]], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("rot", [64, 32])
def test_rope_rows_round_like_the_pairwise_formula(dtype, neox, rot):
    """apply_rope (rope rows, x*cos + partner*signed sin, q and k heads in one call) gives the
    pairwise formula's bits: b*(-s) is -(b*s) exactly and addition commutes."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    x = torch.randn(9, 6, 64, generator=g).to(dtype)
    angles = torch.rand(9, rot // 2, generator=g) * 1000
    cos, sin = angles.cos(), angles.sin()
    assert torch.equal(apply_rope(x, cos, sin, neox), pairwise_rope(x, cos, sin, neox))
    # as the model passes it: q and k heads sliced out of a wider projection output
    wide = torch.cat([x.flatten(1), torch.randn(9, 40, generator=g).to(dtype)], 1)
    xs = wide[:, :6 * 64].view(9, 6, 64)
    assert not xs.is_contiguous()
    assert torch.equal(apply_rope(xs, cos, sin, neox), pairwise_rope(x, cos, sin, neox))


def test_rms_norm_matches_formula():
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=g))
    x = torch.randn(5, 576, generator=g) * 3
    xd = x.double()
    ref = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    err = (norm(x).double() - ref).abs().max().item()
    print(f"rms norm max error {err:.2e}")
    assert err < 1e-5


@pytest.mark.parametrize("head_dim", [64, 128, 192])
def test_kv_rotations_are_orthonormal_involutions(head_dim):
    from kvcompile.kv.rotation import k_rotation, v_rotation
    from kvcompile.ops.kv_format import kv_type
    for name, make in (("K", k_rotation), ("V", v_rotation)):
        r = make(kv_type("q8_0"), head_dim).double()
        err = (r @ r - torch.eye(head_dim, dtype=torch.float64)).abs().max().item()
        print(f"{name} rotation, head dim {head_dim}: max |R R - I| = {err:.1e}")
        assert torch.equal(r, r.T) and err < 1e-6
        assert make(kv_type("f16"), head_dim) is None      # float pages are stored as is
    # span_attention takes the V rotation as its diagonal blocks: nothing off them
    from kvcompile.kv.rotation import V_BLOCK, diagonal_blocks
    r = v_rotation(kv_type("q4_0"), head_dim)
    blocks = diagonal_blocks(r, V_BLOCK)
    assert blocks.shape == (head_dim // V_BLOCK, V_BLOCK, V_BLOCK)
    assert torch.equal(torch.block_diag(*blocks), r)


@pytest.mark.parametrize("n_layers", [1, 2])
def test_llama_forward_adds_each_residual_once(n_layers):
    """LlamaModel.forward defers each block's MLP residual add into the next norm
    (RMSNorm.add): its logits equal, bit for bit, the plain pre-norm formula written out
    with the same modules, x += attn(norm(x)); x += mlp(norm(x)); and last_only gives the
    last row of them."""
    from dataclasses import replace

    from test_kv_cache import TINY, tiny_weights
    from kvcompile.kv.store import KvStore
    from kvcompile.models.layers import rope_rows
    from kvcompile.models.llama import LlamaModel

    c = replace(TINY, n_layers=n_layers)
    model = LlamaModel.from_weights(c, tiny_weights(c, torch.Generator().manual_seed(11)))
    tokens = torch.randint(0, c.vocab_size, (9,), generator=torch.Generator().manual_seed(12))
    positions = torch.arange(9)
    with torch.inference_mode():
        got = model(tokens, positions, KvStore(c, 64, page_size=16))
        last = model(tokens, positions, KvStore(c, 64, page_size=16), last_only=True)
        cache = KvStore(c, 64, page_size=16)
        x = model.embed(tokens)
        cos, sin = rope_rows(model.rope_cos[positions], model.rope_sin[positions], c.rope_neox)
        for i, b in enumerate(model.blocks):
            kv = cache.layer(i)
            x = x + b.attn(b.attn_norm(x), cos, sin, positions.int(), kv)
            x = x + b.mlp(b.ffn_norm(x))
        want = model.lm_head(model.norm(x)).float()
    assert torch.equal(got, want)
    # one row through the LM head's GEMM instead of nine: other blocking, fp32 noise only
    assert ((last - want[-1:]).abs().max() / want.abs().max()).item() < 1e-6
