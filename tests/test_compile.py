"""torch.compile(fullgraph=True) of LlamaModel.forward on the CPU: the kvcompile ops stay
visible in the captured FX graph, inductor compiles the rest, and greedy tokens equal eager."""
from __future__ import annotations

import os
import time

import torch
from torch._inductor.compile_fx import compile_fx

from kvcompile.kv.store import KvStore
from kvcompile.models.llama import LlamaModel
from kvcompile.io.tokenizer import load_tokenizer
from kvcompile.io.weights import load_weights

N_DECODE = 20
PROMPT = "The lighthouse keeper wrote in his notebook that the storm had"


def greedy(forward, cache, prompt: list[int], n_decode: int):
    """Prefill, then n_decode single-token steps; returns tokens, last-row logits, seconds."""
    return greedy_from(forward, cache, prompt, 0, n_decode)


@torch.inference_mode()
def greedy_from(forward, cache, prompt: list[int], start: int, n_decode: int):
    """Prefill prompt[start:] (positions before start already cached), then decode."""
    t0 = time.perf_counter()
    logits = [forward(torch.tensor(prompt[start:]), torch.arange(start, len(prompt)), cache,
                      last_only=True)[-1]]
    tokens = [int(logits[-1].argmax())]
    for pos in range(len(prompt), len(prompt) + n_decode):
        logits.append(forward(torch.tensor(tokens[-1:]), torch.tensor([pos]), cache,
                              last_only=True)[-1])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits), time.perf_counter() - t0


def recording_inductor(graphs: list):
    """A backend that records each captured graph's call_function targets, then hands the
    graph to inductor (CPU C++ kernels)."""
    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return compile_fx(gm, example_inputs)
    return backend


def test_compiled_forward_matches_eager(smollm2_path):
    w = load_weights(smollm2_path, progress=False)
    model = LlamaModel.from_weights(w.config, w.tensors)
    prompt = load_tokenizer(smollm2_path).encode(PROMPT)

    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=recording_inductor(graphs))

    eager_tokens, eager_logits, eager_s = greedy(model, KvStore(w.config, 512), prompt, N_DECODE)
    ours_tokens, ours_logits, compiled_s = greedy(compiled, KvStore(w.config, 512), prompt,
                                                  N_DECODE)
    # a second run reuses the compiled graphs: time it, and it must not recompile
    _, _, rerun_s = greedy(compiled, KvStore(w.config, 512), prompt, N_DECODE)

    n_layers = w.config.n_layers
    op_counts = [(g.count("kvcompile.kv_write"), g.count("kvcompile.span_attention")) for g in graphs]
    diff = (ours_logits - eager_logits).abs().max().item()
    print(f"{len(prompt)} prompt tokens + {N_DECODE} decode steps; graphs captured: {len(graphs)}, "
          f"(kv_write, span_attention) per graph: {op_counts}")
    print(f"eager {eager_s:.1f} s, compiled first run (with compilation) {compiled_s:.1f} s, "
          f"compiled rerun {rerun_s:.2f} s; max |compiled - eager| logit {diff:.3e}")
    print("tokens", ours_tokens)
    assert len(graphs) == 2, "expected one prefill and one decode graph, no per-step recompiles"
    assert all(c == (n_layers, n_layers) for c in op_counts), "the kvcompile ops must stay in the graph"
    assert ours_tokens == eager_tokens
    assert diff < 1e-3


def test_compiled_quantized_kv_with_dynamic_shapes():
    """q8_0 K / q4_0 V (Hadamard-rotated rows) under dynamic=True on a tiny random model:
    the page-format ints stay constants (no SymInt reaches the ops' format checks), logits
    equal eager's up to quantization, and a second generation reuses the compiled graphs.

    Teacher-forced (every forward sees the same tokens): inductor's fused rope/matmul can
    move a K or V value across a q4_0 rounding boundary, which changes its code and the
    logits by up to a quantization step, so the comparison must not feed back its argmax."""
    from test_kv_cache import TINY, tiny_weights
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    model = LlamaModel.from_weights(TINY, tiny_weights(TINY, g))
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=recording_inductor(graphs))
    prompt = torch.randint(0, TINY.vocab_size, (20 + N_DECODE,), generator=g).tolist()
    runs = []
    for fn in (model, compiled, compiled):
        cache = KvStore(TINY, 128, k_type="q8_0", v_type="q4_0", page_size=32)
        with torch.inference_mode():
            rows = [fn(torch.tensor(prompt[:20]), torch.arange(20), cache)]      # chunk of 20
            rows += [fn(torch.tensor([t]), torch.tensor([20 + i]), cache)
                     for i, t in enumerate(prompt[20:])]
        runs.append(torch.cat(rows))
        if fn is compiled and len(runs) == 2:
            n_graphs = len(graphs)      # after the first compiled generation
    diff = (runs[0] - runs[1]).abs().max().item()
    top1 = (runs[0].argmax(-1) == runs[1].argmax(-1)).float().mean().item()
    print(f"seed {seed}: graphs {len(graphs)}, ops per graph "
          f"{[(g.count('kvcompile.kv_write'), g.count('kvcompile.span_attention')) for g in graphs]}, "
          f"max |compiled - eager| logit {diff:.2e}, top-1 agreement {top1:.3f}")
    assert torch.equal(runs[1], runs[2]), "the same compiled graphs must give the same logits"
    assert diff < 5e-2 and top1 >= 0.95
    assert all(g.count("kvcompile.kv_write") == TINY.n_layers for g in graphs)
    assert all(g.count("kvcompile.span_attention") == TINY.n_layers for g in graphs)
    assert n_graphs == len(graphs), "a second generation must reuse the compiled graphs"
