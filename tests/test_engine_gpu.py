"""The model on CUDA (Triton kernels) against the CPU reference path, same weights."""
import pytest
import torch

from kvcompile.engine.engine import Engine
from kvcompile.io.make_model import make_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu_llama") / "tiny.gguf"
    make_model("llama", "tiny", path, weight_type="f32", seed=5)
    return path


def logits_of(engine, ids):
    """Prefill all but the last 16 ids, then one forward per id: every row's logits."""
    engine.store.reset()
    cut = len(ids) - 16
    # each row copied out at once: a captured program's logits are valid until its next step
    rows = [engine._prefill(ids[:cut], 0).float().cpu()]
    rows += [engine.forward([t], cut + i).float().cpu() for i, t in enumerate(ids[cut:-1])]
    return torch.stack(rows)


def agreement(cpu, gpu, seed: int, what: str) -> tuple[float, float]:
    """(top-1 agreement, max |diff| / max |logit|) of two engines' logits over 600 fresh
    random ids."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cpu.model.config.vocab_size, (600,), generator=gen).tolist()
    with torch.inference_mode():
        a, b = logits_of(cpu, ids), logits_of(gpu, ids)
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    rel = ((a - b).abs().max() / a.abs().max()).item()
    print(f"{what}: top-1 {top1:.3f}, max |diff| / max |logit| {rel:.2e}")
    return top1, rel


@pytest.mark.parametrize("kv", ["f32", "f16", "bf16", "q8_0", "q4_0"])
def test_cuda_engine_agrees_with_cpu_reference(tiny_llama, kv):
    cpu = Engine(str(tiny_llama), ctx_size=1024, cache_type_k=kv, cache_type_v=kv,
                 progress=False)
    gpu = Engine(str(tiny_llama), ctx_size=1024, cache_type_k=kv, cache_type_v=kv,
                 device="cuda", dtype="f32", progress=False)
    top1, rel = agreement(cpu, gpu, 11, kv)
    assert top1 >= 0.99 and rel < 2e-2


def test_cuda_generate_runs_and_memory_is_flat(tiny_llama):
    gpu = Engine(str(tiny_llama), ctx_size=1024, device="cuda", cache_type_k="q8_0",
                 cache_type_v="q4_0", dtype="f32", progress=False)
    gpu.generate("warm up", max_tokens=4, temperature=0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    r = gpu.generate("hello there", max_tokens=64, temperature=0)
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    print(f"decode {r.decode_tok_s:.1f} tok/s, memory growth {grown} B")
    assert r.completion_tokens > 0 and grown < 1 << 20


def test_cuda_engine_defaults_to_bf16(tiny_llama):
    """dtype "auto" on CUDA: bf16 weights and activations (f32 stays the CPU default); its
    logits within bf16 noise of the CPU fp32 reference."""
    cpu = Engine(str(tiny_llama), ctx_size=1024, progress=False)
    gpu = Engine(str(tiny_llama), ctx_size=1024, device="cuda", progress=False)
    assert cpu.dtype == torch.float32 and gpu.dtype == torch.bfloat16
    assert gpu.model.lm_head.weight.dtype == torch.bfloat16
    top1, rel = agreement(cpu, gpu, 13, "bf16 default")
    assert top1 >= 0.85 and rel < 0.05      # measured 0.938 and 9.5e-3 on the H200
