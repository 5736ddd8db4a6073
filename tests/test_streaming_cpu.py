"""The streaming runtime on the CPU backend against an all-resident KvStore.

A tiny random llama model with 16-position pages gives many pages and much streaming in
little time; the real-weight test runs SmolLM2 at ~1K context.
"""
from __future__ import annotations

import os
import random
import threading

import pytest
import torch

from kvcompile.models.config import ModelConfig
from kvcompile.errors import KvLayoutError
from kvcompile.kv.store import KvStore
from kvcompile.models.llama import LlamaModel
from kvcompile.ops import kv_format as F
from kvcompile.kv.backend import CpuBackend
from kvcompile.kv.checker import FenceChecker
from kvcompile.kv.copy_engine import Instrument
from kvcompile.kv.kv_pages import min_arena_bytes
from kv_steps import forward
from kvcompile.kv.arena import MIB, align
from kvcompile.kv.fences import EventFence
from kvcompile.kv.policy import DECODE_ROWS

SEED = int.from_bytes(os.urandom(4), "little")
PS = 16
MAX_TOKENS = 320
CFG = ModelConfig(arch="llama", n_layers=5, hidden=128, ffn=256, n_heads=4, n_kv_heads=2,
                  head_dim=64, vocab_size=256, context_length=1024)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(SEED)
    return LlamaModel(CFG).eval()


_REFS = {}


def _prompt(seed, n):
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def generate(model, cache, prompt, n_decode, chunk=40, on_step=None, start=0, decode=None):
    """Greedy: prefill in chunks (from `start`: earlier rows are already cached), then
    decode (through `decode(ids, start)` when given: a captured step); returns (token ids,
    logits of every forward)."""
    logits = []
    for s in range(start, len(prompt), chunk):
        t = prompt[s:s + chunk]
        logits.append(forward(model, cache, t, torch.arange(s, s + len(t)), last_only=True))
        if on_step:
            on_step(len(logits), cache, s + len(t))
    ids = [int(logits[-1][-1].argmax())]
    for pos in range(len(prompt), len(prompt) + n_decode):
        logits.append(forward(model, cache, torch.tensor([ids[-1]]), torch.tensor([pos]),
                              last_only=True) if decode is None else
                      decode([ids[-1]], pos).clone())
        ids.append(int(logits[-1][-1].argmax()))
        if on_step:
            on_step(len(logits), cache, pos + 1)
    return ids, torch.cat(logits)


def _mib(pages, types=("f32", "f32")):
    kb, vb = (F.page_bytes(F.kv_type(t), PS, CFG.n_kv_heads, CFG.head_dim) for t in types)
    return (align(pages * kb) + align(pages * vb)) / MIB


def _reference(model, types, prompt, n_decode):
    """All-resident dense-cache run, memoized per (types, prompt, n_decode)."""
    key = (types, tuple(prompt.tolist()), n_decode)
    if key not in _REFS:
        cache = KvStore(CFG, MAX_TOKENS, k_type=types[0], v_type=types[1], page_size=PS)
        _REFS[key] = generate(model, cache, prompt, n_decode)
    return _REFS[key]


PROMPT_LEN = random.Random(SEED).randrange(270, 300)   # ~19 of the 20 pages at the end


F32, QUANT = ("f32", "f32"), ("q8_0", "q4_0")


# 20 pages = the minimum (the ring holds one layer's context, nothing resident)
@pytest.mark.parametrize("types,pages", [(F32, 20), (F32, 44), (F32, 200), (QUANT, 20),
                                         (QUANT, 60)])
def test_streamed_output_is_bitwise_the_all_resident_output(model, types, pages):
    prompt = _prompt(SEED, PROMPT_LEN)
    ids_ref, ref = _reference(model, types, prompt, 16)
    cache = KvStore(CFG, MAX_TOKENS, arena_mib=_mib(pages, types), k_type=types[0],
                             v_type=types[1], page_size=PS)
    ids, got = generate(model, cache, prompt, 16)
    assert ids == ids_ref and torch.equal(got, ref), (SEED, pages)
    st = cache.stats()
    for s in cache.telemetry:
        assert s.resident_pages + s.ring_slots == cache.streamer.pool.P
        assert s.resident_reads + s.streamed_reads == CFG.n_layers * s.context_pages
        assert s.readiness_misses == 0                  # synchronous copies are always ready
    if pages == 20:                                     # >= 90% of the KV streamed
        for s in cache.telemetry[-16:]:
            assert s.streamed_reads >= 0.9 * (s.streamed_reads + s.resident_reads), s
    if pages == 200:
        assert st["streamed_fraction"] == 0 and st["h2d_bytes"] == 0, st


def test_pages_padded_to_16_bytes_stream_bitwise(model):
    """Pages of 3 positions: a q8_0 K page is 408 bytes and a q4_0 V page 216, so each is
    padded to a multiple of 16 in the arena's and the host's page pairs (kv_pages.PagePair);
    the streamed tokens and logits still equal the all-resident cache's."""
    ps, n = 3, 120
    prompt = _prompt(SEED, 100)
    ref = KvStore(CFG, n, k_type="q8_0", v_type="q4_0", page_size=ps)
    ids_ref, logits_ref = generate(model, ref, prompt, 8)
    need = min_arena_bytes(CFG, n, "q8_0", "q4_0", ps)
    cache = KvStore(CFG, n, arena_mib=need * 1.6 / MIB, k_type="q8_0",
                             v_type="q4_0", page_size=ps)
    k_pool = cache.streamer.pool.k_pool
    assert (k_pool.shape[1], cache.streamer.pool.v_pool.shape[1], k_pool.stride(0)) == (408, 216, 640)
    ids, got = generate(model, cache, prompt, 8)
    assert ids == ids_ref and torch.equal(got, logits_ref), SEED
    assert sum(s.streamed_reads for s in cache.telemetry[-8:]) > 0
    cache.close()


def test_copies_are_grouped_runs_of_contiguous_pages(model):
    prompt = _prompt(SEED, 200)
    cache = KvStore(CFG, MAX_TOKENS, arena_mib=_mib(30), page_size=PS)
    generate(model, cache, prompt, 4)
    kb = F.page_bytes(F.F32, PS, CFG.n_kv_heads, CFG.head_dim)
    last = cache.telemetry[-1]
    streamed_with_rows = last.streamed_reads       # every streamed page has published rows
    assert last.h2d_bytes == streamed_with_rows * 2 * kb
    # one copy per run; a run splits only where the ring wraps: <= 2 per layer
    assert cache.streamer.pool.count["copies"] <= 2 * CFG.n_layers
    assert cache.streamer.pool.count["copies"] < streamed_with_rows


def test_host_history_equals_the_dense_cache_after_every_forward(model):
    types = ("q8_0", "q4_0")
    prompt = _prompt(SEED + 7, 170)
    dense = KvStore(CFG, MAX_TOKENS, k_type=types[0], v_type=types[1], page_size=PS)
    generate(model, dense, prompt, 8)
    seen = []

    def check(step, cache, rows):
        assert set(cache.history.rows.values()) == {rows}
        pages = -(-rows // PS)
        for i in cache.layers:
            kv = dense.layer(i)
            for host, pool, t, role in ((cache.history.k[i], kv.k_pool, cache.k_type, "k"),
                                        (cache.history.v[i], kv.v_pool, cache.v_type, "v")):
                a = F.decode_pages(host[:pages], t, CFG.n_kv_heads, PS, CFG.head_dim, role=role)
                b = F.decode_pages(pool[kv.page_table[:pages].long()], t, CFG.n_kv_heads, PS,
                                   CFG.head_dim, role=role)
                flat = lambda x: x.permute(1, 0, 2, 3).reshape(CFG.n_kv_heads, -1, CFG.head_dim)
                assert torch.equal(flat(a)[:, :rows], flat(b)[:, :rows]), (SEED, step, i)
        seen.append(step)

    cache = KvStore(CFG, MAX_TOKENS, arena_mib=_mib(24, types), k_type=types[0],
                             v_type=types[1], page_size=PS)
    generate(model, cache, prompt, 8, on_step=check)
    assert len(seen) == len(cache.telemetry)


def test_dropping_every_resident_page_mid_generation_changes_nothing(model):
    prompt = _prompt(SEED, PROMPT_LEN)
    ids_ref, ref = _reference(model, F32, prompt, 16)
    drop_at = random.Random(SEED).randrange(6, 14)
    resident_before = []

    def drop(step, cache, rows):
        if step == drop_at:
            resident_before.append(cache.streamer.pool.r)
            cache.drop_resident()

    cache = KvStore(CFG, MAX_TOKENS, arena_mib=_mib(60), page_size=PS)
    ids, got = generate(model, cache, prompt, 16, on_step=drop)
    assert resident_before and resident_before[0] > 0
    assert ids == ids_ref and torch.equal(got, ref), (SEED, drop_at)
    after = cache.telemetry[drop_at]                 # the forward after the drop refilled
    kb = F.page_bytes(F.F32, PS, CFG.n_kv_heads, CFG.head_dim)
    assert after.h2d_bytes >= after.resident_reads * 2 * kb - CFG.n_layers * 2 * kb


def _threaded(pages, checker, copy_ms, compute_ms, unsafe=frozenset(), seed=SEED, types=F32):
    rng, lock = random.Random(seed), threading.Lock()

    def delay(ms):
        def f():
            with lock:
                return rng.random() * ms / 1000
        return f
    inst = Instrument(checker=checker, copy_delay=delay(copy_ms), compute_delay=delay(compute_ms))
    return KvStore(CFG, MAX_TOKENS, arena_mib=_mib(pages, types), k_type=types[0],
                            v_type=types[1], page_size=PS, unsafe=unsafe,
                            backend=CpuBackend(threaded_copies=True, instrument=inst))


# Quantized pages also prove kv_write touches only its own pages while copies run.
@pytest.mark.parametrize("types,copy_ms,compute_ms", [(F32, 4, 0.5), (F32, 0.5, 4),
                                                      (QUANT, 2, 2)])
def test_fences_hold_under_injected_delays(model, types, copy_ms, compute_ms):
    prompt = _prompt(SEED, PROMPT_LEN)
    ids_ref, ref = _reference(model, types, prompt, 16)
    checker = FenceChecker()
    cache = _threaded(50, checker, copy_ms, compute_ms, types=types)  # ring ~2 layers: overlap
    try:
        ids, got = generate(model, cache, prompt, 16)
    finally:
        cache.close()
    assert checker.violations == [], (SEED, checker.violations[:3])
    assert checker.events > 100
    assert ids == ids_ref and torch.equal(got, ref), SEED
    last = cache.telemetry[-1]
    assert last.streamed_reads > last.ring_slots > 0     # slots are reused within a forward
    # decode steps run on a ring of 1.5 layers: fills split around the layer before
    assert last.tokens == 1, last
    assert any(s.tokens == 1 and s.split_layers > 0 for s in cache.telemetry), last
    assert any(s.tokens > 1 and not s.split_layers for s in cache.telemetry), SEED


@pytest.mark.parametrize("types", [F32, QUANT], ids=["f32", "q8_0-q4_0"])
def test_captured_decode_steps_hold_the_fences_under_injected_delays(model, types):
    """Decode steps in fixed layouts (executor/executor.py; on the CPU each replay reruns
    the step) through a threaded copy engine with random copy and compute delays: no fence
    violation, the resident decode's tokens and logits; 16-token pages, so the decode
    crosses page boundaries (a new layout each). Each step ends by filling the next step's
    first layers, still in flight when that step's program (which skips them) runs."""
    from kvcompile.executor.executor import Executor
    prompt = _prompt(SEED + 5, PROMPT_LEN - 10)   # room for 24 decoded tokens
    ids_ref, ref = _reference(model, types, prompt, 24)
    checker = FenceChecker()
    cache = _threaded(50, checker, 2, 2, seed=SEED + 5, types=types)
    program = Executor(model, cache, ubatch=40, capture=True, strict=True)
    try:
        ids, got = generate(model, cache, prompt, 24,
                            decode=lambda t, pos: program.step(t, pos, all_rows=True))
    finally:
        cache.close()
    assert checker.violations == [], (SEED, checker.violations[:3])
    assert ids == ids_ref and torch.equal(got, ref), SEED
    s = program.program_stats()
    assert s["replays"] == 23 and s["captures"] >= 2, s
    assert cache.telemetry[-1].replayed and cache.telemetry[-1].streamed_reads > 0
    layouts = list(program.programs[("step", 1)])
    assert any(layout.ahead for layout in layouts), layouts
    # decode's own split (a ring of 1.5 layers), its new resident pages refilled before
    # the first captured step; the fills split around the layer before (at a step's begin
    # the layer before holds its slots; later ones may find them released, by timing)
    tel = cache.telemetry
    # (a forward of up to DECODE_ROWS rows counts as decode: the prompt's last chunk may)
    assert any(s.tokens <= DECODE_ROWS and s.repartitioned and "decode" in s.policy
               for s in tel), SEED
    assert any(s.tokens == 1 and s.split_layers > 0 for s in tel), SEED


@pytest.mark.parametrize("unsafe,copy_ms,compute_ms,expect", [
    ("skip_ready_wait", 15, 0, "read-before-ready"),
    ("skip_consumed_wait", 0, 5, "overwrite-before-consumed"),
])
def test_broken_ordering_is_caught(model, unsafe, copy_ms, compute_ms, expect):
    checker = FenceChecker()
    cache = _threaded(20, checker, copy_ms, compute_ms, unsafe={unsafe})
    try:
        generate(model, cache, _prompt(SEED + 5, 100), 3)
    finally:
        cache.close()
    assert any(v.startswith(expect) for v in checker.violations), checker.violations[:3]


def test_repartition_waits_for_pages_the_device_may_still_use(model):
    # the pool's own call between forwards: no forward begun ahead
    cache = KvStore(CFG, MAX_TOKENS, arena_mib=_mib(60), page_size=PS,
                             prefetch_next=False)
    generate(model, cache, _prompt(SEED, 60), 1)
    r = cache.streamer.pool.r
    page = cache.streamer.pool.L * (r - 1)                 # a resident page that becomes a ring slot
    pending = EventFence("compute still reading")
    cache.streamer.pool.last_use[page] = pending
    assert page in cache.streamer.pool.leased_pages()
    threading.Timer(0.05, pending.set).start()
    cache.streamer.pool.repartition(r - 1)
    assert pending.query() and cache.streamer.pool.r == r - 1


def test_failed_forward_leaves_the_cache_usable(model):
    prompt = _prompt(SEED, PROMPT_LEN)
    ids_ref, ref = _reference(model, F32, prompt, 16)
    cache = KvStore(CFG, MAX_TOKENS, arena_mib=_mib(30), page_size=PS)

    class Boom(Exception):
        pass

    def broken(tokens, positions, cache, last_only):
        cache.layer(0)
        cache.layer(1)
        raise Boom

    with torch.inference_mode():
        forward(model, cache, prompt[:40], torch.arange(40))
        with pytest.raises(Boom):
            forward(broken, cache, prompt[40:80], torch.arange(40, 80))
    assert set(cache.history.rows.values()) == {40}      # the failed rows are not history
    assert all(h is None for h in cache.streamer.pool.holder)  # prefetched slots were given back
    with pytest.raises(KvLayoutError):
        cache.layer(0)                                # only inside a forward
    ids, got = generate(model, cache, prompt, 16, start=40)
    assert ids == ids_ref and torch.equal(got, ref[1:]), SEED


def test_failed_forward_before_any_layer_waits_for_its_refills(model):
    """Found by review: a forward that fails before acquiring a layer had issued refills of
    dropped resident pages that the next forward counted as landed. With a slow copy stream
    and the fence checker, the next decode must equal the all-resident cache bitwise."""
    checker, delay = FenceChecker(), [0.0]
    backend = CpuBackend(threaded_copies=True,
                         instrument=Instrument(checker=checker, copy_delay=lambda: delay[0]))
    cache = KvStore(CFG, MAX_TOKENS, 6 * min_arena_bytes(CFG, MAX_TOKENS,
                                                                  page_size=PS) / MIB,
                             page_size=PS, backend=backend)
    ref = KvStore(CFG, MAX_TOKENS, page_size=PS)
    prompt = _prompt(SEED, 100)

    class Boom(Exception):
        pass

    def broken(tokens, positions, cache, last_only):
        raise Boom

    with torch.inference_mode():
        forward(model, cache, prompt, torch.arange(100))
        model(prompt, torch.arange(100), ref)
        cache.drop_resident()                 # the next issue refills every resident page
        delay[0] = 0.2
        with pytest.raises(Boom):
            forward(broken, cache, prompt[:1], torch.tensor([100]))
        got = forward(model, cache, prompt[:1], torch.tensor([100]), last_only=True)
        want = model(prompt[:1], torch.tensor([100]), ref, last_only=True)
    cache.close()
    assert torch.equal(got, want) and not checker.violations, checker.violations[:2]


def test_reset_between_sequences(model):
    """A second sequence after reset() sees none of the first one's pages."""
    first, second = _prompt(SEED + 1, 250), _prompt(SEED, PROMPT_LEN)
    ids_ref, ref = _reference(model, F32, second, 16)
    cache = KvStore(CFG, MAX_TOKENS, arena_mib=_mib(60), page_size=PS)
    generate(model, cache, first, 8)
    assert cache.streamer.pool.r > 0                   # resident pages hold the first sequence
    cache.reset()
    ids, got = generate(model, cache, second, 16)
    assert ids == ids_ref and torch.equal(got, ref), SEED


def test_a_forward_over_one_layer_only(model):
    """An MTP-style forward acquires a single layer; its rows are tracked per layer."""
    g = torch.Generator().manual_seed(SEED)
    dense = KvStore(CFG, MAX_TOKENS, page_size=PS)
    cache = KvStore(CFG, MAX_TOKENS, arena_mib=_mib(22), page_size=PS)
    outs = []
    for c in (dense, cache):
        torch.manual_seed(SEED)
        outs.append(generate(model, c, _prompt(SEED, 150), 2)[1])
    layer, pos = CFG.n_layers - 1, 0
    for n in (37, 1, 90, 1):
        positions = torch.arange(pos, pos + n)
        k, v = (torch.randn(n, CFG.n_kv_heads, CFG.head_dim, generator=g) for _ in "kv")
        q = torch.randn(n, CFG.n_heads, CFG.head_dim, generator=g)
        res = []
        for c in (dense, cache):
            if c is cache:
                cache.begin_forward(positions, layers=[layer])
            kv = c.layer(layer)
            torch.ops.kvcompile.kv_write(kv.k_pool, kv.v_pool, k, v, positions,
                                         kv.k_type, kv.v_type, PS, kv.page_table)
            res.append(torch.ops.kvcompile.span_attention(
                q, kv.k_pool, kv.v_pool, kv.page_table, positions.to(torch.int32), kv.k_type,
                kv.v_type, PS, 0.125))
            if c is cache:
                cache.end_forward()
        assert torch.equal(res[0], res[1]), (SEED, n)
        pos += n
    assert cache.history.rows[layer] == pos and cache.history.rows[0] == 152
    assert cache.telemetry[-1].layers == 1
    assert torch.equal(outs[0], outs[1])


def test_arena_zero_means_all_on_device_and_bad_sizes_fail_clearly(model):
    from kvcompile.errors import ArenaError
    resident = KvStore(CFG, MAX_TOKENS, 0, page_size=PS)
    assert resident.resident and not resident.streams
    streaming = KvStore(CFG, MAX_TOKENS, _mib(20), page_size=PS)
    assert streaming.streams and not streaming.resident
    for bad in (-1, "8"):
        with pytest.raises(ArenaError, match="kv-stream-arena-mib"):
            KvStore(CFG, MAX_TOKENS, bad, page_size=PS)
    # after an error the process (and a cache) stays usable
    prompt = _prompt(SEED, PROMPT_LEN)
    ids_ref, ref = _reference(model, F32, prompt, 16)
    ids, got = generate(model, streaming, prompt, 16)
    assert ids == ids_ref and torch.equal(got, ref)


def test_a_failed_copy_surfaces_instead_of_being_read(model):
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 12:
            raise OSError("injected copy failure")
        return 0.0
    inst = Instrument(checker=FenceChecker(), copy_delay=flaky)
    cache = KvStore(CFG, MAX_TOKENS, arena_mib=_mib(24), page_size=PS,
                             backend=CpuBackend(threaded_copies=True, instrument=inst))
    try:
        with pytest.raises(RuntimeError, match="failed") as e:
            generate(model, cache, _prompt(SEED, PROMPT_LEN), 4)
        assert isinstance(e.value.__cause__, OSError)
    finally:
        cache.close()


class _Watched(EventFence):
    waited = False

    def wait(self):
        self.waited = True
        super().wait()


def test_forced_repartition_drains_pages_still_in_use(model):
    from kvcompile.kv.policy import serves
    prompt = _prompt(SEED, PROMPT_LEN)
    ids_ref, ref = _reference(model, F32, prompt, 16)
    cache = KvStore(CFG, MAX_TOKENS, arena_mib=_mib(60), page_size=PS)
    held = []

    def hold(step, cache, rows):
        # Before the forward whose context the current split cannot serve, pretend the
        # device still reads the highest resident page (the first to change role).
        last = min(rows + 40, len(prompt)) if rows < len(prompt) else rows + 1
        if held or serves(cache.streamer.policy_config, cache.streamer.pool.r, (last - 1) // PS + 1):
            return
        fence = _Watched("device still reading")
        cache.streamer.pool.last_use[cache.streamer.pool.L * cache.streamer.pool.r - 1] = fence
        threading.Timer(0.1, fence.set).start()
        held.append((len(cache.telemetry), fence))

    ids, got = generate(model, cache, prompt, 16, on_step=hold)
    assert held, "the split never had to shrink"
    i, fence = held[0]
    assert cache.telemetry[i].repartitioned and "forced" in cache.telemetry[i].policy
    assert fence.waited and fence.query()
    assert ids == ids_ref and torch.equal(got, ref), SEED


def test_smollm2_tiny_arena_matches_all_resident_at_1k_context(smollm2_path):
    """Real weights, ~1K context, q8_0/q4_0 KV: a tiny arena (the ring holds one layer's
    context, nothing resident) gives the same greedy tokens and bitwise the same logits."""
    from kvcompile.io.weights import load_weights
    w = load_weights(smollm2_path, progress=False)
    smol = LlamaModel.from_weights(w.config, w.tensors)
    rng = random.Random(SEED)
    n_prompt, n_decode, max_tokens = rng.randrange(980, 1024), 16, 1100
    prompt = torch.randint(0, w.config.vocab_size, (n_prompt,),
                           generator=torch.Generator().manual_seed(SEED))
    kt, vt = "q8_0", "q4_0"
    ref_cache = KvStore(w.config, max_tokens, k_type=kt, v_type=vt)
    ids_ref, ref = generate(smol, ref_cache, prompt, n_decode, chunk=256)
    tiny = min_arena_bytes(w.config, max_tokens, kt, vt) * 1.2 / MIB
    cache = KvStore(w.config, max_tokens, arena_mib=tiny, k_type=kt, v_type=vt)
    ids, got = generate(smol, cache, prompt, n_decode, chunk=256)
    assert ids == ids_ref, (SEED, ids, ids_ref)
    assert torch.equal(got, ref), SEED
    decode = cache.telemetry[-n_decode:]
    streamed = sum(s.streamed_reads for s in decode)
    assert streamed >= 0.9 * sum(s.streamed_reads + s.resident_reads for s in decode)
    assert all(s.h2d_bytes > 0 for s in decode)


def test_the_next_decode_step_is_begun_ahead_and_a_wrong_guess_costs_nothing(model):
    """After each forward the cache begins the next decode step (its first layers' fills
    issued at once); the bytes are counted to that step, and the telemetry and tokens equal
    a cache that does not guess. A forward that is not the guess (a 3-row verify-like step,
    a rewind) drops it: same tokens, no fence violation."""
    prompt = _prompt(SEED, PROMPT_LEN)
    ids_ref, ref = _reference(model, F32, prompt, 12)
    runs = {}
    for ahead in (False, True):
        cache = KvStore(CFG, MAX_TOKENS, arena_mib=_mib(30), page_size=PS,
                                 prefetch_next=ahead)
        issued_at_end = []

        def watch(step, cache, rows):
            issued_at_end.append(cache.streamer._next is not None)
        with torch.inference_mode():
            ids, got = generate(model, cache, prompt, 12, on_step=watch)
        runs[ahead] = [(t.h2d_bytes, t.resident_reads, t.streamed_reads, t.repartitioned)
                       for t in cache.telemetry]
        assert ids == ids_ref and torch.equal(got, ref), (SEED, ahead)
        assert any(issued_at_end) == ahead and (not ahead or all(issued_at_end))
    # the same bytes and reads a step, but where the split changed: the guess begun before
    # it was dropped, and the fills it had issued count to that step
    assert [r[1:] for r in runs[True]] == [r[1:] for r in runs[False]], SEED
    for a, b in zip(runs[True], runs[False]):
        assert a[0] == b[0] if not a[3] else a[0] >= b[0], (SEED, a, b)
    checker = FenceChecker()
    cache = _threaded(30, checker, 1, 1)
    try:
        with torch.inference_mode():
            ids, got = generate(model, cache, prompt, 4)
            pos = len(prompt) + 4
            three = forward(model, cache, torch.tensor(ids[-3:]), torch.arange(pos, pos + 3))
            cache.truncate(pos)           # a rejected verify: rewind, decode the first again
            again = forward(model, cache, torch.tensor(ids[-3:-2]), torch.tensor([pos]))
    finally:
        cache.close()
    assert checker.violations == [], (SEED, checker.violations[:3])
    # (one row and three rows take different matmul paths: equal to rounding)
    torch.testing.assert_close(again[-1], three[0], rtol=1e-5, atol=1e-5)
