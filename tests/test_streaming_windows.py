"""Windowed layers over a streamed KV store (CPU backend): they copy and read only their
window's pages, and the output stays bitwise the all-resident store's.

A tiny random model whose layers 0, 1, 3, 4 attend over the last 40 positions (pages of
16) and layer 2 over everything; copies on their own thread with random delays and the
fence checker watching every page.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from kvcompile.kv.backend import CpuBackend
from kvcompile.kv.checker import FenceChecker
from kvcompile.kv.copy_engine import Instrument
from kvcompile.kv.store import KvStore
from kvcompile.models.config import ModelConfig
from kvcompile.models.llama import LlamaModel
from test_streaming_cpu import MAX_TOKENS, PS, _mib, generate

SEED = int.from_bytes(os.urandom(4), "little")
WINDOW = 40
CFG = ModelConfig(arch="llama", n_layers=5, hidden=128, ffn=256, n_heads=4, n_kv_heads=2,
                  head_dim=64, vocab_size=256, context_length=1024, sliding_window=WINDOW,
                  sliding_window_pattern=3)
F32, QUANT = ("f32", "f32"), ("q8_0", "q4_0")
CHUNK = 40


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(SEED)
    m = LlamaModel(CFG).eval()
    assert m.layer_plan.windows == tuple((i, WINDOW) for i in (0, 1, 3, 4))
    return m


def _prompt(n):
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(SEED))


def _store(model, types, pages, checker, windows=None, delays=True, window_rows=0):
    rng = random.Random(SEED)
    delay = (lambda: rng.uniform(0, 0.002)) if delays else None
    inst = Instrument(checker=checker, copy_delay=delay, compute_delay=delay)
    options = {} if windows is None else dict(windows=windows)
    options["window_rows"] = window_rows
    return KvStore.for_model(model, MAX_TOKENS, types[0], types[1], _mib(pages, types),
                             page_size=PS, **options,
                             backend=CpuBackend(threaded_copies=True, instrument=inst))


def _forwards(n_prompt, n_decode):
    """(lo, hi) of each forward generate() runs."""
    out = [(s, min(s + CHUNK, n_prompt) - 1) for s in range(0, n_prompt, CHUNK)]
    return out + [(p, p) for p in range(n_prompt, n_prompt + n_decode)]


def _pages_read(lo, hi):
    """Pages attention reads in a forward over [lo, hi): every page for the global layer,
    from the window's first page (of the forward's first page) on for the windowed ones."""
    n = hi // PS + 1
    first = max((lo // PS) * PS - WINDOW + 1, 0) // PS
    return n + 4 * (n - first)


@pytest.mark.parametrize("types,pages", [(F32, 20), (QUANT, 44)],
                         ids=["f32-ring-only", "q8_0-q4_0-resident-and-ring"])
def test_windowed_layers_stream_only_their_window(model, types, pages):
    prompt = _prompt(random.Random(SEED).randrange(250, 290))
    resident = KvStore.for_model(model, MAX_TOKENS, types[0], types[1], page_size=PS)
    ids_ref, ref = generate(model, resident, prompt, 16, chunk=CHUNK)
    runs = {}
    for name, windows in (("windowed", None), ("every page", {})):
        checker = FenceChecker()
        store = _store(model, types, pages, checker, windows)
        try:
            ids, got = generate(model, store, prompt, 16, chunk=CHUNK)
        finally:
            store.close()
        assert checker.violations == [], (SEED, checker.violations[:3])
        assert ids == ids_ref and torch.equal(got, ref), (SEED, name)
        runs[name] = store
    tel = runs["windowed"].telemetry
    assert [s.resident_reads + s.streamed_reads for s in tel] == [
        _pages_read(lo, hi) for lo, hi in _forwards(len(prompt), 16)], SEED
    h2d = {name: store.stats()["h2d_bytes"] for name, store in runs.items()}
    print(f"\nh2d bytes {h2d}")
    assert h2d["windowed"] < 0.6 * h2d["every page"], h2d


@pytest.mark.parametrize("types", [F32, QUANT], ids=["f32", "q8_0-q4_0"])
def test_captured_decode_steps_over_windowed_layers(model, types):
    """Decode steps as captured programs (each layout's windowed placements fixed by its
    first page, the next step's first layers filled ahead) under random delays: the
    resident store's tokens and logits, no fence violation."""
    program = _captured_decode_equals_resident(
        model, types, lambda checker: _store(model, types, 50, checker))
    assert any(layout.ahead for layout in program.programs[("step", 1)]), SEED


def _captured_decode_equals_resident(model, types, make_store):
    """24 decode steps as captured programs over make_store(checker) against the resident
    store: equal tokens and logits, no fence violation, 23 replays; returns the executor."""
    from kvcompile.executor.executor import Executor
    prompt = _prompt(250)
    ids_ref, ref = generate(model, KvStore.for_model(model, MAX_TOKENS, types[0], types[1],
                                                     page_size=PS), prompt, 24, chunk=CHUNK)
    checker = FenceChecker()
    store = make_store(checker)
    program = Executor(model, store, ubatch=CHUNK, capture=True, strict=True)
    try:
        ids, got = generate(model, store, prompt, 24, chunk=CHUNK,
                            decode=lambda t, pos: program.step(t, pos, all_rows=True))
    finally:
        store.close()
    assert checker.violations == [], (SEED, checker.violations[:3])
    assert ids == ids_ref and torch.equal(got, ref), SEED
    assert program.program_stats()["replays"] == 23
    return program


def _rings_store(model, types, checker, pages=40):
    """Window rings sized for the prefill chunks: the pool keeps `pages` pages for layer 2."""
    from kvcompile.kv.window_rings import window_slots
    slots = window_slots(WINDOW, CHUNK, PS)
    return _store(model, types, pages + 4 * slots, checker, window_rows=CHUNK)


@pytest.mark.parametrize("types", [F32, QUANT], ids=["f32", "q8_0-q4_0"])
def test_window_rings_keep_the_windows_on_the_device(model, types):
    """window_rows: each windowed layer keeps its window in a ring of its own. Bitwise the
    all-resident output under random delays and the fence checker; the decode steps copy
    nothing of the windowed layers (only the global layer's streamed pages cross)."""
    prompt = _prompt(250)
    ids_ref, ref = generate(model, KvStore.for_model(model, MAX_TOKENS, types[0], types[1],
                                                     page_size=PS), prompt, 16, chunk=CHUNK)
    checker = FenceChecker()
    store = _rings_store(model, types, checker)
    try:
        ids, got = generate(model, store, prompt, 16, chunk=CHUNK)
    finally:
        store.close()
    assert checker.violations == [], (SEED, checker.violations[:3])
    assert ids == ids_ref and torch.equal(got, ref), SEED
    rings, pool = store.streamer.rings, store.streamer.pool
    assert pool.layers == (2,) and set(rings.windows) == {0, 1, 3, 4}
    page_bytes = pool.kv_pool.shape[1]
    for s in store.telemetry[-15:]:             # decode steps
        assert s.tokens == 1
        global_streamed = s.context_pages - min(pool.r, s.context_pages)
        assert s.h2d_bytes == global_streamed * page_bytes, (SEED, s)


def test_window_rings_refill_after_the_device_pages_are_dropped(model):
    """Every device page thrown away mid-generation (and a new sequence after): the rings
    refill from host history; the output stays the resident one."""
    prompt = _prompt(200)
    ids_ref, ref = generate(model, KvStore.for_model(model, MAX_TOKENS, page_size=PS),
                            prompt, 12, chunk=CHUNK)
    checker = FenceChecker()
    store = _rings_store(model, F32, checker)

    def drop(step, cache, pos):
        if step in (3, 7, 11):
            cache.drop_resident()
    try:
        ids, got = generate(model, store, prompt, 12, chunk=CHUNK, on_step=drop)
        store.reset()
        ids2, got2 = generate(model, store, prompt, 12, chunk=CHUNK)
    finally:
        store.close()
    assert checker.violations == [], (SEED, checker.violations[:3])
    assert ids == ids2 == ids_ref and torch.equal(got, ref) and torch.equal(got2, ref), SEED


@pytest.mark.parametrize("types", [F32, QUANT], ids=["f32", "q8_0-q4_0"])
def test_captured_decode_steps_over_window_rings(model, types):
    """Captured decode steps with window rings (their pages placed before each new layout,
    nothing copied inside a step): the resident output, no fence violation."""
    _captured_decode_equals_resident(model, types,
                                     lambda checker: _rings_store(model, types, checker))


def test_a_forward_wider_than_the_rings_is_refused(model):
    from kvcompile.errors import KvLayoutError
    from kv_steps import forward
    store = _rings_store(model, F32, None)
    with pytest.raises(KvLayoutError, match="window_rows"):
        forward(model, store, _prompt(120), torch.arange(120))
    ids, _ = generate(model, store, _prompt(60), 2, chunk=CHUNK)   # it keeps serving
    assert len(ids) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rings", [False, True], ids=["shared-ring", "window-rings"])
def test_cuda_windowed_layers_streamed_equal_all_resident(rings):
    """On the CUDA backend (copy stream, event fences, captured decode steps): windowed
    layers through the shared ring or in rings of their own give the all-resident store's
    tokens and logits bitwise; with rings, decode steps copy only the global layer's pages."""
    from kvcompile.executor.executor import Executor
    torch.manual_seed(SEED)
    with torch.device("cuda"):
        model = LlamaModel(CFG).eval().requires_grad_(False)
    prompt = _prompt(250).cuda()
    ref_store = KvStore.for_model(model, MAX_TOKENS, "q8_0", "q4_0", page_size=PS)
    with torch.device("cuda"):                   # generate's positions and token tensors
        ids_ref, ref = generate(model, ref_store, prompt, 24, chunk=CHUNK)
    from kvcompile.kv.window_rings import window_slots
    pages = 40 + (4 * window_slots(WINDOW, CHUNK, PS) if rings else 0)
    store = KvStore.for_model(model, MAX_TOKENS, "q8_0", "q4_0", _mib(pages, QUANT),
                              page_size=PS, window_rows=CHUNK if rings else 0)
    assert (store.streamer.rings is not None) == rings
    program = Executor(model, store, ubatch=CHUNK, capture=True)
    try:
        with torch.device("cuda"):
            ids, got = generate(model, store, prompt, 24, chunk=CHUNK,
                                decode=lambda t, pos: program.step(t, pos, all_rows=True))
    finally:
        store.close()
    assert ids == ids_ref and torch.equal(got.cpu(), ref.cpu()), SEED
    if rings:
        pool = store.streamer.pool
        page_bytes = pool.kv_pool.shape[1]
        for s in store.telemetry[-20:]:
            assert s.h2d_bytes <= (s.context_pages - min(pool.r, s.context_pages)) * page_bytes


def test_rings_hold_the_widest_verify_step(model):
    """An Engine's window rings are sized for its widest forward: with a ubatch of 16 and
    ngram drafts of up to 24 tokens that is a verify step of 32 padded rows, not the ubatch
    (nor the MTP depth); long ngram rounds through window rings give plain decoding's
    tokens."""
    from kvcompile.engine.engine import Engine
    prompt = torch.randperm(CFG.vocab_size, generator=torch.Generator().manual_seed(SEED))
    # (the context sets the shared ring: one layer's pages; the rings take 3 pages a layer)
    opts = dict(ctx_size=1024, ubatch=16, progress=False, kv_stream_arena_mib=4.5)
    plain = Engine.from_model(model, **opts).generate(prompt.tolist(), max_tokens=24,
                                                      temperature=0)
    e = Engine.from_model(model, spec_type="ngram-simple", spec_ngram_size_n=1,
                          spec_ngram_size_m=24, **opts)
    assert e.store.window_rows == 32 and e.store.streamer.rings is not None
    r = e.generate(prompt.tolist(), max_tokens=24, temperature=0)
    assert r.token_ids == plain.token_ids, SEED
    assert r.speculative["drafted"] > 24, r.speculative
