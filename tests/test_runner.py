"""The executor through Engine.from_model: a model built in memory, prompts as token ids;
greedy tokens against a recompute-everything oracle, streamed against resident, one split a
request (no repartition storm), per-request program counters, host times."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvcompile.engine.engine import Engine
from kvcompile.errors import KvcompileError
from kvcompile.kv.store import KvStore
from kvcompile.models.llama import LlamaModel
from kernel_oracle import fresh_seed
from test_kv_cache import TINY, tiny_weights

CFG = replace(TINY, context_length=4096)


@pytest.fixture(scope="module")
def seed():
    return fresh_seed()


@pytest.fixture(scope="module")
def model(seed):
    return LlamaModel.from_weights(CFG, tiny_weights(CFG, torch.Generator().manual_seed(seed)))


def recompute_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The oracle: every token from a fresh cache and one forward over the whole sequence,
    no incremental decode, no chunking, no streaming."""
    ids = list(prompt)
    for _ in range(n):
        cache = KvStore(CFG, len(ids))
        logits = model(torch.tensor(ids), torch.arange(len(ids)), cache, last_only=True)
        ids.append(int(logits[-1].argmax()))
    return ids[len(prompt):]


@torch.inference_mode()
def test_from_model_engine_matches_recompute_and_streams_identically(model, seed):
    gen = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(0, CFG.vocab_size, (700,), generator=gen).tolist()
    want = recompute_greedy(model, prompt, 6)
    resident = Engine.from_model(model, ctx_size=1024, ubatch=128, progress=False)
    # 1.3 MiB of 2 MiB of f32 KV (the ring must hold one layer's 1 MiB): most of it streams
    streamed = Engine.from_model(model, ctx_size=1024, ubatch=128, progress=False,
                                 kv_stream_arena_mib=1.3)
    a = resident.generate(prompt, max_tokens=6, temperature=0)
    b = streamed.generate(prompt, max_tokens=6, temperature=0)
    assert a.token_ids == want and b.token_ids == want, (seed, a.token_ids, b.token_ids, want)
    assert a.text == "" and a.finish_reason == "length"
    # one host time per forward: 6 prefill chunks of 128, then 5 decode steps
    assert len(b.host_s) == 6 + 5 and len(b.step_s) == 5
    assert b.stats()["host_step_ms"] > 0
    assert b.kv["streamed_fraction"] > 0.3
    # the request planned its split for 706 tokens at its first forward: no repartition
    # as prefill and decode grew the context (a drain each)
    assert b.kv["repartitions"] <= 1, b.kv


@torch.inference_mode()
def test_second_request_captures_nothing(model, seed):
    """cuda_graphs on the CPU: the same programs, traced and rerun in their fixed layouts;
    the counters are per request, and the second request, whose prompt the store holds,
    computes the prompt's last chunk again (the same logits) and replays what the first
    request captured."""
    gen = torch.Generator().manual_seed(seed + 2)
    prompt = torch.randint(0, CFG.vocab_size, (40,), generator=gen).tolist()
    e = Engine.from_model(model, ctx_size=256, ubatch=16, progress=False, cuda_graphs=True)
    assert e.executor.mode == "cuda graphs"
    first = e.generate(prompt, max_tokens=5, temperature=0)
    second = e.generate(prompt, max_tokens=5, temperature=0)
    assert first.token_ids == second.token_ids == recompute_greedy(model, prompt, 5)
    # prefill/16 (its first chunk traces, the second captures), the prompt's last 8
    # tokens as step/8 (traced), then step/1: traced, captured, replayed
    p = first.programs
    assert (p["captures"], p["replays"], p["eager_steps"]) == (2, 1 + 3, 3), p
    # the last 8 tokens again (step/8, now captured), then four replayed decode steps
    p = second.programs
    assert second.cached_tokens == 32 and p["eager_steps"] == 0, p
    assert p["captures"] == 1 and p["replays"] == 1 + 4, p


def test_without_a_tokenizer_prompts_are_token_ids_and_errors_keep_serving(model):
    e = Engine.from_model(model, ctx_size=256, progress=False)
    with pytest.raises(KvcompileError, match="list of token ids"):
        e.generate("some text", max_tokens=2)
    with pytest.raises(KvcompileError, match="list of token ids"):
        e.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(KvcompileError, match="need a model file"):
        Engine.from_model(model, kv_stream_arena_mib="auto")
    r = e.generate([1, 2, 3], max_tokens=3, temperature=0)
    assert r.completion_tokens == 3


@torch.inference_mode()
def test_hybrid_streamed_equals_resident_through_the_runner(tmp_path, seed):
    """qwen35 (GDN recurrent layers + gated attention) from a synthetic file: up to 64
    greedy tokens through a tiny streamed arena equal the all-resident engine's."""
    from kvcompile.io.make_model import make_model
    from kvcompile.kv.kv_pages import min_arena_bytes
    path = tmp_path / "qwen35.gguf"
    make_model("qwen35", "tiny", path, weight_type="f32", seed=seed % 1000)
    resident = Engine(str(path), ctx_size=1024, ubatch=128, progress=False)
    mib = min_arena_bytes(replace(resident.model.config, n_layers=resident.model.config.n_layers + 1),
                          1024) * 1.1 / 2**20
    streamed = Engine(str(path), ctx_size=1024, ubatch=128, progress=False,
                      kv_stream_arena_mib=mib)
    gen = torch.Generator().manual_seed(seed + 3)
    prompt = torch.randint(0, resident.model.config.vocab_size, (600,), generator=gen).tolist()
    a = resident.generate(prompt, max_tokens=64, temperature=0)
    b = streamed.generate(prompt, max_tokens=64, temperature=0)
    # (an end-of-sequence token may stop both early: random weights)
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason, seed
    assert b.kv["streamed_fraction"] > 0.3 and b.kv["repartitions"] <= 1, b.kv
