"""A hybrid qwen35 model (Gated DeltaNet + attention layers + an MTP layer) through the
streaming cache equals the same model over an all-resident KvStore, bitwise. Main
forwards acquire only the attention layers, MTP forwards only the MTP layer, whose rows
the host history tracks separately."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from kvcompile.kv.store import KvStore
from kvcompile.ops import kv_format as F
from kvcompile.kv.arena import MIB, align
from tiny_hybrid import tiny_hybrid, write_tiny_hybrid

SEED = int.from_bytes(os.urandom(4), "little")
PS, MAX_TOKENS = 16, 160


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return tiny_hybrid(tmp_path_factory.mktemp("hybrid"), SEED % 1000)


@torch.inference_mode()
def _run(model, cache, tokens, n_prompt):
    main = model.layer_plan.kv_layers[:-1]
    mtp = model.layer_plan.kv_layers[-1:]
    out = []
    for s in range(0, n_prompt, 48):
        t = tokens[s:min(s + 48, n_prompt)]
        pos = torch.arange(s, s + len(t))
        cache_begin(cache, pos, main)
        logits, hidden = model(t, pos, cache, return_hidden=True)
        cache_end(cache)
        out.append(logits)
        nxt = tokens[s + 1:s + 1 + len(t)]
        cache_begin(cache, pos[:len(nxt)], mtp)
        out.append(model.mtp_forward(nxt, hidden[:len(nxt)], pos[:len(nxt)], cache))
        cache_end(cache)
    for p in range(n_prompt, len(tokens) - 1):
        pos = torch.tensor([p])
        cache_begin(cache, pos, main)
        logits, hidden = model(tokens[p:p + 1], pos, cache, return_hidden=True)
        cache_end(cache)
        cache_begin(cache, pos, mtp)
        out.append(model.mtp_forward(tokens[p + 1:p + 2], hidden, pos, cache))
        cache_end(cache)
        out.append(logits)
    return torch.cat(out)


def cache_begin(cache, positions, layers):
    if isinstance(cache, KvStore):
        cache.begin_forward(positions, layers)


def cache_end(cache):
    if isinstance(cache, KvStore):
        cache.end_forward()


def test_hybrid_model_with_mtp_streams_bitwise(hybrid):
    c = hybrid.config
    gen = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, c.vocab_size, (MAX_TOKENS - 8,), generator=gen)
    n_prompt = len(tokens) - 12
    dense = KvStore.for_model(hybrid, MAX_TOKENS, page_size=PS)
    ref = _run(hybrid, dense, tokens, n_prompt)
    kb = F.page_bytes(F.F32, PS, c.n_kv_heads, c.head_dim)
    pages = -(-MAX_TOKENS // PS) + 2
    cache = KvStore.for_model(hybrid, MAX_TOKENS, arena_mib=(2 * align(pages * kb)) / MIB,
                              page_size=PS)
    got = _run(hybrid, cache, tokens, n_prompt)
    assert torch.equal(got, ref), SEED
    main_steps = [s for s in cache.telemetry if s.layers == len(hybrid.layer_plan.kv_layers) - 1]
    mtp_steps = [s for s in cache.telemetry if s.layers == 1]
    assert main_steps and mtp_steps
    assert sum(s.streamed_reads for s in main_steps[-4:]) > 0
    assert cache.history.rows[hybrid.layer_plan.kv_layers[0]] == len(tokens) - 1
    assert cache.history.rows[hybrid.layer_plan.kv_layers[-1]] == len(tokens) - 1


def test_engine_streams_a_hybrid_model_without_mtp_pages(tmp_path):
    """Engine with an arena and no MTP drafter: the MTP layer gets no pages (the trunk's
    attention layers get its share of the arena), and it generates what the all-resident
    engine does."""
    from kvcompile.engine.engine import Engine
    from kvcompile.kv.kv_pages import min_arena_bytes
    path = write_tiny_hybrid(tmp_path / "qwen35-tiny.gguf", SEED % 1000)
    ref = Engine(str(path), ctx_size=256, progress=False)
    full = replace(ref.model.config, n_layers=ref.model.config.n_layers + ref.model.config.nextn_layers)
    need = min_arena_bytes(full, 256) / MIB
    streamed = Engine(str(path), ctx_size=256, kv_stream_arena_mib=need * 1.1, progress=False)
    trunk = [i for i in streamed.model.layer_plan.kv_layers if i < ref.model.config.n_layers]
    prompt = "the quick brown fox jumps over the lazy dog " * 8
    want = ref.generate(prompt, max_tokens=12, temperature=0)
    got = streamed.generate(prompt, max_tokens=12, temperature=0)
    assert got.token_ids == want.token_ids
    steps = streamed.store.telemetry
    assert steps and all(s.layers == len(trunk) for s in steps)
    mtp = streamed.model.layer_plan.mtp[0]
    assert mtp not in streamed.store.layers        # no MTP drafter: the layer has no pages
    assert got.kv["streamed_fraction"] > 0.5
