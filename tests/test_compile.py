"""torch.compile(fullgraph=True) of LlamaModel.forward on the CPU: the kvcompile ops stay
visible in the captured FX graph, inductor compiles the rest, and greedy tokens equal eager."""
from __future__ import annotations

import time

import pytest
import torch
from torch._inductor.compile_fx import compile_fx

from kvcompile.kv_cache import PagedKvCache
from kvcompile.models.llama import LlamaModel
from kvcompile.tokenizer import load_tokenizer
from kvcompile.weights import load_weights

N_DECODE = 20
PROMPT = "The lighthouse keeper wrote in his notebook that the storm had"


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)   # the cores are shared; see test_llama_parity
    yield
    torch.set_num_threads(before)


@torch.inference_mode()
def greedy(forward, cache, prompt: list[int], n_decode: int):
    """Prefill, then n_decode single-token steps; returns tokens, last-row logits, seconds."""
    t0 = time.perf_counter()
    logits = [forward(torch.tensor(prompt), torch.arange(len(prompt)), cache, last_only=True)[-1]]
    tokens = [int(logits[-1].argmax())]
    for pos in range(len(prompt), len(prompt) + n_decode):
        logits.append(forward(torch.tensor(tokens[-1:]), torch.tensor([pos]), cache,
                              last_only=True)[-1])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits), time.perf_counter() - t0


def test_compiled_forward_matches_eager(smollm2_path):
    w = load_weights(smollm2_path, progress=False)
    model = LlamaModel.from_weights(w.config, w.tensors)
    prompt = load_tokenizer(smollm2_path).encode(PROMPT)

    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return compile_fx(gm, example_inputs)      # inductor (CPU C++ kernels)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=recording_backend)

    eager_tokens, eager_logits, eager_s = greedy(model, PagedKvCache(w.config, 512), prompt, N_DECODE)
    ours_tokens, ours_logits, compiled_s = greedy(compiled, PagedKvCache(w.config, 512), prompt,
                                                  N_DECODE)
    # a second run reuses the compiled graphs: time it, and it must not recompile
    _, _, rerun_s = greedy(compiled, PagedKvCache(w.config, 512), prompt, N_DECODE)

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
