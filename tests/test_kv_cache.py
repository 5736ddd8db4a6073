"""KvStore and LlamaModel.from_weights: geometry, layer subsets, and the errors a user
can cause (each a KvcompileError subclass that says what to change). Tiny random models."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from kvcompile.models.config import ModelConfig
from kvcompile.errors import ContextLengthError, KvLayoutError, ModelFileError, UnsupportedModelError
from kvcompile.kv.store import KvStore
from kvcompile.models.llama import LlamaModel
from kvcompile.ops import kv_format as F

TINY = ModelConfig(arch="llama", n_layers=2, hidden=128, ffn=256, n_heads=4, n_kv_heads=2,
                   head_dim=64, vocab_size=300, context_length=600, rope_theta=10000.0)


def tiny_weights(c: ModelConfig, g: torch.Generator) -> dict[str, torch.Tensor]:
    def mat(o, i):
        return torch.randn(o, i, generator=g) / i ** 0.5

    w = {"token_embd.weight": torch.randn(c.vocab_size, c.hidden, generator=g),
         "output_norm.weight": 1 + 0.1 * torch.randn(c.hidden, generator=g),
         "output.weight": mat(c.vocab_size, c.hidden) * 4}
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    for i in range(c.n_layers):
        p = f"blk.{i}."
        w |= {p + "attn_norm.weight": 1 + 0.1 * torch.randn(c.hidden, generator=g),
              p + "ffn_norm.weight": 1 + 0.1 * torch.randn(c.hidden, generator=g),
              p + "attn_q.weight": mat(q, c.hidden), p + "attn_k.weight": mat(kv, c.hidden),
              p + "attn_v.weight": mat(kv, c.hidden), p + "attn_output.weight": mat(c.hidden, q),
              p + "ffn_gate.weight": mat(c.ffn, c.hidden), p + "ffn_up.weight": mat(c.ffn, c.hidden),
              p + "ffn_down.weight": mat(c.hidden, c.ffn)}
    return w


@pytest.fixture
def gen():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("k_type,v_type", [("f32", "f32"), ("q8_0", "q4_0"), ("bf16", "f16")])
def test_cache_geometry(k_type, v_type):
    cache = KvStore(TINY, 300, k_type=k_type, v_type=v_type, page_size=256)
    per_token = sum(F.bytes_per_token(F.kv_type(t), TINY.n_kv_heads, TINY.head_dim)
                    for t in (k_type, v_type))
    print(f"{k_type}/{v_type}: capacity {cache.capacity}, {cache.nbytes} bytes")
    assert cache.capacity == 512 and cache.num_pages == 2
    assert cache.nbytes == per_token * cache.capacity * TINY.n_layers
    # all resident: logical page lp of layer index li is physical page lp * L + li, for good
    assert cache.layer(1).page_table.tolist() == [1, 3]
    assert cache.layer(0).page_table.tolist() == [0, 2]


def test_layer_subset_and_hybrid_default():
    assert KvStore(TINY, 10, layers=[1]).layers == (1,)
    hybrid = replace(TINY, n_layers=8, full_attention_interval=4)
    cache = KvStore(hybrid, 10)
    print("hybrid KV layers", cache.layers)
    assert cache.layers == (3, 7) and not cache.has_layer(0)
    with pytest.raises(KvLayoutError, match="outside"):
        KvStore(TINY, 10, layers=[2])


def test_bad_sizes_are_rejected():
    with pytest.raises(ContextLengthError):
        KvStore(TINY, 0)
    with pytest.raises(KvLayoutError, match="cache type"):
        KvStore(TINY, 10, k_type="q5_9")


def test_positions_outside_the_cache_or_model_raise(gen):
    model = LlamaModel.from_weights(TINY, tiny_weights(TINY, gen))
    cache = KvStore(TINY, 20, page_size=16)            # capacity 32
    with pytest.raises(ContextLengthError, match="ctx-size") as e:
        model(torch.tensor([1, 2]), torch.tensor([31, 32]), cache)
    print(e.value)
    big = KvStore(TINY, 700, page_size=256)             # capacity 768 > model's 600
    with pytest.raises(ContextLengthError, match="context length") as e:
        model(torch.tensor([1]), torch.tensor([650]), big)
    print(e.value)


def test_from_weights_rejects_incomplete_or_foreign_tensors(gen):
    w = tiny_weights(TINY, gen)
    with pytest.raises(ModelFileError, match="lacks"):
        LlamaModel.from_weights(TINY, {k: v for k, v in w.items() if k != "blk.1.ffn_up.weight"})
    with pytest.raises(ModelFileError, match="shape"):
        LlamaModel.from_weights(TINY, w | {"blk.0.attn_k.weight": torch.randn(64, 128)})
    with pytest.raises(ModelFileError, match="beyond"):
        LlamaModel.from_weights(TINY, w | {"blk.2.attn_norm.weight": torch.randn(128)})
    with pytest.raises(UnsupportedModelError, match="no place"):
        LlamaModel.from_weights(TINY, w | {"blk.0.ssm_conv1d.weight": torch.randn(4, 4)})


def test_bf16_model_tracks_fp32(gen):
    w = tiny_weights(TINY, gen)
    tokens = torch.randint(0, TINY.vocab_size, (40,), generator=gen)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = LlamaModel.from_weights(TINY, w, dtype=dtype)
        with torch.inference_mode():
            out[dtype] = model(tokens, torch.arange(40), KvStore(TINY, 40, k_type="bf16",
                                                                      v_type="bf16"))
    ref, got = out[torch.float32], out[torch.bfloat16]
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean().item()
    top1 = (ref.argmax(-1) == got.argmax(-1)).double().mean().item()
    print(f"bf16 weights vs fp32: dtype {got.dtype}, top-1 {top1:.2%}, mean KL {kl:.2e}")
    assert got.dtype == torch.float32 and kl < 2e-2 and top1 >= 0.8


def test_rotation_only_for_quantized_pages_and_can_be_turned_off(gen):
    """Rotated or not, quantized KV approximates the f32 cache; rotation is never applied to
    float pages, and rotate=False stores quantized rows as they are."""
    model = LlamaModel.from_weights(TINY, tiny_weights(TINY, gen))
    tokens = torch.randint(0, TINY.vocab_size, (50,), generator=gen)
    logits = {}
    for name, kwargs in (("f32", {}), ("q8_0 rotated", dict(k_type="q8_0", v_type="q8_0")),
                         ("q8_0 plain", dict(k_type="q8_0", v_type="q8_0", rotate=False))):
        cache = KvStore(TINY, 50, **kwargs)
        rotated = cache.layer(0).k_rot is not None
        assert rotated == (name == "q8_0 rotated") and (cache.layer(0).v_rot is not None) == rotated
        with torch.inference_mode():
            logits[name] = model(tokens, torch.arange(50), cache)
    for name in ("q8_0 rotated", "q8_0 plain"):
        err = (logits[name] - logits["f32"]).abs().max().item()
        print(f"{name} vs f32 KV: max |logit diff| {err:.3e}")
        assert 0 < err < 0.5
