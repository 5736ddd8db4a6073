"""A llama model whose matrices stay in GGUF block formats (QuantWeights through the qlinear
op and the quantized embedding) against its dense twin holding the same dequantized values.

CPU (tiny geometry, fp32): the reference op is the dequantized product, so logits agree to
fp32 rounding. Device (marked gpu): the Llama-3-8B geometry in Q4_K, Q6_K, Q8_0 and IQ4_XS
against the twin in bf16 (cuBLAS and the dense GEMV), logits taken in fp32 from the head's
input (Fp32Head): over 512 teacher-forced positions top-1 agreement >= 99% and mean KL <=
1e-3, and 64 greedy tokens equal except where the twin's top two logits lie within 0.05 (a
tie either side may break). The device model writes
its residual stream with gain 0.3 (residual_gain): at gain 1 a random 32-layer stack is
chaotic, and the two bf16 computations (cuBLAS over chunked or whole matrices, GEMV or
cuBLAS) already differed in 6-7% of top-1s with mean KL 9e-4 on the H200.
"""
from __future__ import annotations

import pytest
import torch

from kernel_oracle import fresh_seed
from kvcompile.ops import debug
from kvcompile.kv.store import KvStore
from kvcompile.models.llama import LlamaModel
from quant_models import model_config, quantized_pair


def build(arch_preset, weight_type, device, dtype, seed, **overrides):
    cfg, quant, dense = quantized_pair("llama", arch_preset, weight_type, device, dtype, seed,
                                       **overrides)
    config = model_config(cfg)
    mq = LlamaModel.from_weights(config, quant, dtype=dtype, device=device)
    md = LlamaModel.from_weights(config, dense, dtype=dtype, device=device)
    return config, mq, md


class Fp32Head:
    """Calls of `model` returning fp32 logits: the head's input (the final normed hidden
    state, bf16) times the head's exact weights in fp32. bf16 logits of a 128K vocabulary
    tie often (the top two share a bf16 value in several percent of positions), which
    decides argmaxes by accident; the head kernel itself is covered by the kernel tests."""

    def __init__(self, model):
        self.model, self.hidden = model, None
        head = model.lm_head
        w = head.quant_weight().dequantize() if head.qtype else head.weight.float()
        self.weight = w
        head.register_forward_hook(lambda mod, args, out: setattr(self, "hidden", args[0]))

    def __call__(self, *args, **kw):
        self.model(*args, **kw)
        return self.hidden.float() @ self.weight.t()

    @property
    def config(self):
        return self.model.config


@torch.inference_mode()
def teacher_forced(model, tokens, kv="f32"):
    cache = KvStore(model.config, tokens.numel() + 8, 0, kv, kv, device=tokens.device)
    return model(tokens, torch.arange(tokens.numel(), device=tokens.device), cache).float()


@torch.inference_mode()
def greedy(model, prompt, n, kv="f32"):
    """n greedy tokens and the top-2 logit gap at each step."""
    cache = KvStore(model.config, prompt.numel() + n + 8, 0, kv, kv, device=prompt.device)
    logits = model(prompt, torch.arange(prompt.numel(), device=prompt.device), cache,
                   last_only=True)[-1]
    out, gaps = [], []
    for pos in range(prompt.numel(), prompt.numel() + n):
        top = logits.float().topk(2)
        out.append(int(top.indices[0]))
        gaps.append(float(top.values[0] - top.values[1]))
        logits = model(torch.tensor([out[-1]], device=prompt.device),
                       torch.tensor([pos], device=prompt.device), cache, last_only=True)[-1]
    return out, gaps


def compare(lq, ld):
    top1 = (lq.argmax(-1) == ld.argmax(-1)).float().mean().item()
    kl = torch.nn.functional.kl_div(lq.log_softmax(-1), ld.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1).mean().item()
    return top1, kl


def greedy_agree(ours, ref, gaps, tie=0.05) -> bool:
    """Equal, or equal up to a step where the reference's top two lie within `tie`."""
    for a, b, g in zip(ours, ref, gaps):
        if a != b:
            return g < tie
    return True


@pytest.mark.parametrize("weight_type", ["q4_k", "q6_k", "q8_0", "iq4_xs"])
def test_quantized_tiny_llama_equals_its_dense_twin_on_cpu(weight_type):
    seed = fresh_seed() % 10_000
    config, mq, md = build("tiny", weight_type, "cpu", torch.float32, seed)
    assert mq.blocks[0].mlp.gate_up.qtype and mq.embed.qtype and mq.lm_head.qtype
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (40,), generator=gen)
    lq, ld = teacher_forced(mq, tokens), teacher_forced(md, tokens)
    torch.testing.assert_close(lq, ld, rtol=1e-4, atol=1e-4)
    assert greedy(mq, tokens[:8], 6)[0] == greedy(md, tokens[:8], 6)[0]


def test_quantized_model_compiles_through_the_pass_pipeline(monkeypatch):
    """torch.compile with the pass pipeline as backend (whose last pass refuses custom ops
    without a lowering) takes the qlinear / qembedding ops: prefill and decode of the
    compiled quantized model equal the model run directly, bitwise."""
    from kvcompile.passes import pipeline as P
    from test_passes import compiled_through_pipeline, prefill_then_decode
    monkeypatch.setattr(debug, "DISABLE_PASSES", frozenset())
    seed = fresh_seed() % 10_000
    config, mq, _ = build("tiny", "q4_k", "cpu", torch.float32, seed)
    prompt = torch.randint(0, config.vocab_size, (12,),
                           generator=torch.Generator().manual_seed(seed))
    compiled, graphs, _ = compiled_through_pipeline(mq)
    assert torch.equal(prefill_then_decode(compiled, config, prompt)[0],
                       prefill_then_decode(mq, config, prompt)[0])
    assert len(graphs) == 2
    assert all("kvcompile.qlinear" in P.call_targets(gm) for gm in graphs)
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("weight_type", ["q4_k", "q6_k", "q8_0", "iq4_xs"])
def test_quantized_8b_agrees_with_its_bf16_twin(weight_type):
    seed = fresh_seed() % 10_000
    config, mq, md = build("llama3-8b", weight_type, "cuda", torch.bfloat16, seed,
                           context_length=4096, residual_gain=0.3)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (512,), generator=gen).cuda()
    mq, md = Fp32Head(mq), Fp32Head(md)
    top1, kl = compare(teacher_forced(mq, tokens, "bf16"), teacher_forced(md, tokens, "bf16"))
    ours, _ = greedy(mq, tokens[:32], 64, "bf16")
    ref, gaps = greedy(md, tokens[:32], 64, "bf16")
    same = sum(a == b for a, b in zip(ours, ref))
    near_ties = greedy_agree(ours, ref, gaps)
    print(f"{weight_type}: teacher-forced top-1 {top1:.4f}, mean KL {kl:.2e}; greedy "
          f"{same}/64 equal, first difference at "
          f"{next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)}, "
          f"{'only' if near_ties else 'not only'} at near-ties")
    # every line checked, each failing one named (the floor test below bounds the first)
    failed = [what for what, ok in (("top-1 >= 0.99", top1 >= 0.99), ("mean KL <= 1e-3",
              kl <= 1e-3), ("greedy equal but near ties", near_ties)) if not ok]
    assert not failed, ", ".join(failed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_twins_agreement_floor():
    """The floor under the agreement above: the same bf16 matrices twice, once dense (cuBLAS
    over whole matrices, the dense GEMV) and once as BF16 QuantWeights (the qlinear kernels,
    cuBLAS over 64 MiB row chunks): identical weights, so what differs is only the order of
    the sums. Printed beside the quantized types' figures (the top-1 agreement a random
    32-layer stack allows two correct bf16 computations); the distributions must agree."""
    seed = fresh_seed() % 10_000
    config, mq, md = build("llama3-8b", "bf16", "cuda", torch.bfloat16, seed,
                           context_length=4096, residual_gain=0.3)
    assert mq.blocks[0].mlp.gate_up.qtype and not md.blocks[0].mlp.gate_up.qtype
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (512,), generator=gen).cuda()
    mq, md = Fp32Head(mq), Fp32Head(md)
    top1, kl = compare(teacher_forced(mq, tokens, "bf16"), teacher_forced(md, tokens, "bf16"))
    print(f"bf16 twins: teacher-forced top-1 {top1:.4f}, mean KL {kl:.2e}")
    assert kl <= 1e-3
