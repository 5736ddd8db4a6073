"""LlamaModel on SmolLM2-135M against llama.cpp (llama-cpp-python).

Exact oracle: llama.cpp on an F32 GGUF written from the same dequantized weights.
On the original Q4_1 file llama.cpp quantizes activations inside its matmuls, so only
looser agreement is expected there. Tokens come from llama.cpp's tokenizer.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvcompile.kv.store import KvStore
from kvcompile.models.llama import LlamaModel
from kvcompile.io.weights import load_weights
from llama_oracle import agreement, llama_cpp, llama_cpp_greedy, llama_cpp_logits, our_greedy

TEXT = Path(__file__).parent / "data" / "parity_text.txt"
N_GREEDY = 64
RAW_PROMPTS = [
    "The three primary colours of light are",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "Once upon a time, in a village at the edge of a great forest, there lived",
    "Q: How many minutes are there in a day?\nA:",
    "Les montagnes en hiver sont",
]
CHAT_PROMPTS = [
    "What is the boiling point of water at sea level, in Celsius and Fahrenheit?",
    "Write a short poem about a cat watching the rain.",
    "Explain recursion to a ten-year-old.",
    "Give me a Python one-liner that reverses a string.",
    "List three tips for sleeping better.",
]


def chatml(user: str) -> str:
    return ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
            "Hugging Face<|im_end|>\n<|im_start|>user\n" + user +
            "<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    w = load_weights(smollm2_path, progress=False)
    return w.config, LlamaModel.from_weights(w.config, w.tensors)


@pytest.fixture(scope="module")
def llm_f32(smollm2_f32_path):
    llm = llama_cpp(smollm2_f32_path)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def text_tokens(llm_f32):
    tokens = llm_f32.tokenize(TEXT.read_bytes(), add_bos=False, special=True)
    print(f"parity text: {len(tokens)} tokens")
    assert len(tokens) >= 512
    return tokens


@pytest.fixture(scope="module")
def our_text_logits(smollm2, text_tokens):
    """Teacher-forced logits of the whole text, fed the way a session is: a prefill chunk
    that crosses a page boundary, single decode rows, then more chunks."""
    config, model = smollm2
    cache = KvStore(config, len(text_tokens))
    cuts = [0, 300, 301, 302, 700, len(text_tokens)]
    rows = []
    with torch.inference_mode():
        for a, b in zip(cuts, cuts[1:]):
            rows.append(model(torch.tensor(text_tokens[a:b]), torch.arange(a, b), cache))
    return torch.cat(rows)


@pytest.fixture(scope="module")
def oracle_text_logits(llm_f32, text_tokens):
    return llama_cpp_logits(llm_f32, text_tokens)


def test_teacher_forced_matches_llama_cpp_f32(oracle_text_logits, text_tokens, our_text_logits):
    ref = oracle_text_logits
    top1, kl, kl_max = agreement(our_text_logits, ref)
    diff = (our_text_logits - ref).abs().max().item()
    print(f"F32 GGUF, {len(text_tokens)} tokens: top-1 {top1:.4%}, mean KL {kl:.3e}, "
          f"max KL {kl_max:.3e}, max |logit diff| {diff:.3e}")
    assert top1 >= 0.995 and kl <= 1e-4


def test_teacher_forced_matches_llama_cpp_q4_1(smollm2_path, text_tokens, our_text_logits):
    llm = llama_cpp(smollm2_path)
    try:
        ref = llama_cpp_logits(llm, text_tokens)
    finally:
        llm.close()
    top1, kl, kl_max = agreement(our_text_logits, ref)
    print(f"Q4_1 GGUF, {len(text_tokens)} tokens: top-1 {top1:.4%}, mean KL {kl:.3e}, "
          f"max KL {kl_max:.3e}")
    assert top1 >= 0.95 and kl <= 5e-3


@pytest.mark.parametrize("kind,prompt", [
    # one of each kind in the README's test command, the rest with `-m slow` (CI runs both)
    pytest.param(kind, p, marks=() if i < 1 else pytest.mark.slow)
    for kind, prompts in (("raw", RAW_PROMPTS), ("chat", CHAT_PROMPTS))
    for i, p in enumerate(prompts)])
def test_greedy_continuation_matches_llama_cpp_f32(smollm2, llm_f32, kind, prompt):
    config, model = smollm2
    text = chatml(prompt) if kind == "chat" else prompt
    tokens = llm_f32.tokenize(text.encode(), add_bos=False, special=True)
    ref, gaps = llama_cpp_greedy(llm_f32, tokens, N_GREEDY)
    ours = our_greedy(model, KvStore(config, len(tokens) + N_GREEDY), tokens, N_GREEDY)
    print(f"{kind} prompt {prompt[:40]!r}: {len(tokens)} prompt tokens; llama.cpp says "
          f"{llm_f32.detokenize(ref).decode(errors='replace')[:80]!r}; "
          f"smallest top-2 gap {min(gaps):.4f}")
    for step, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            print(f"  near tie accepted? step {step}: ours {a}, llama.cpp {b}, "
                  f"llama.cpp top-2 gap {gaps[step]:.4f}")
            assert gaps[step] < 0.05, f"greedy tokens diverge at step {step} without a near tie"
            return
    print(f"  all {N_GREEDY} tokens identical")


@pytest.mark.parametrize("k_type,v_type", [   # the most used pair in the README's command
    pytest.param("f16", "f16", marks=pytest.mark.slow),
    pytest.param("q8_0", "q8_0", marks=pytest.mark.slow), ("q8_0", "q4_0")])
def test_quantized_kv_cache_degrades_like_llama_cpp(smollm2, smollm2_f32_path, text_tokens,
                                                    oracle_text_logits, k_type, v_type):
    """Smaller KV types end to end. Against the exact oracle (llama.cpp, f32 KV) our loss must
    be no worse than llama.cpp's own with the same KV types (both store quantized rows
    Hadamard-rotated; without the rotation q8_0 K loses about twice as much)."""
    config, model = smollm2
    tokens = text_tokens[:600]
    ids = {"f16": 1, "q8_0": 8, "q4_0": 2}
    llm = llama_cpp(smollm2_f32_path, type_k=ids[k_type], type_v=ids[v_type])
    try:
        theirs = llama_cpp_logits(llm, tokens)
    finally:
        llm.close()
    cache = KvStore(config, len(tokens), k_type=k_type, v_type=v_type)
    with torch.inference_mode():
        ours = torch.cat([model(torch.tensor(tokens[a:b]), torch.arange(a, b), cache)
                          for a, b in ((0, 300), (300, 301), (301, len(tokens)))])
    exact = oracle_text_logits[: len(tokens)]
    top1, kl, _ = agreement(ours, exact)
    top1_cpp, kl_cpp, _ = agreement(theirs, exact)
    top1_pair, kl_pair, _ = agreement(ours, theirs)
    print(f"KV {k_type}/{v_type} over {len(tokens)} tokens vs the f32-KV oracle: ours top-1 "
          f"{top1:.2%} KL {kl:.2e}; llama.cpp top-1 {top1_cpp:.2%} KL {kl_cpp:.2e}; "
          f"ours vs llama.cpp same KV: top-1 {top1_pair:.2%} KL {kl_pair:.2e}")
    assert kl <= 1.5 * kl_cpp + 1e-6 and top1 >= top1_cpp - 0.02


def test_permuted_page_tables_give_identical_logits(smollm2, text_tokens):
    """Placement independence at model level: every layer with its own page permutation."""
    config, model = smollm2
    tokens = torch.tensor(text_tokens[:600])          # three 256-position pages
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    results = []
    for permute in (False, True):
        cache = KvStore(config, 1024)           # four pages, one never used
        if permute:
            for layer in cache.layers:       # each layer's pages, in another order
                table = cache.layer(layer).page_table
                table.copy_(table[torch.randperm(cache.num_pages, generator=g)])
            print("layer 0 table", cache.layer(0).page_table.tolist(),
                  "layer 1 table", cache.layer(1).page_table.tolist())
        with torch.inference_mode():
            a = model(tokens[:590], torch.arange(590), cache)
            b = model(tokens[590:591], torch.tensor([590]), cache)
            c = model(tokens[591:], torch.arange(591, 600), cache)
        results.append(torch.cat([a, b, c]))
    print(f"max |identity - permuted| = {(results[0] - results[1]).abs().max().item()}")
    assert torch.equal(results[0], results[1])
