"""Host-side cost of a streamed decode step: counted on the CPU through the real CUDA backend
code, with torch.cuda's events and streams replaced by counting fakes
(tools/profile/count_stream_calls.py), plus the pieces that make the counts small: implied
fence waits skipped, one position read per forward, leased pages gathered only when the
policy would change the split, page tables written for all layers at once.
"""
from __future__ import annotations

import importlib.util
import os
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvcompile.models.config import ModelConfig
from kvcompile.errors import ContextLengthError, KvLayoutError
from kvcompile.kv.store import KvStore
from kvcompile.models.llama import LlamaModel
from kvcompile.ops import kv_format as F
from kv_steps import forward
from kvcompile.kv import policy as P
from kvcompile.kv.arena import MIB, align
from kvcompile.kv.copy_engine import CopyNote
from kvcompile.kv.fences import DONE, EventFence, latest_per_stream

SEED = int.from_bytes(os.urandom(4), "little")
_spec = importlib.util.spec_from_file_location(
    "count_stream_calls", Path(__file__).parents[1] / "tools" / "profile" / "count_stream_calls.py")
C = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(C)


def test_a_decode_step_makes_few_calls_and_one_host_read():
    """8 layers, 32 pages per layer, a ring for ~1.5 layers: most pages stream, the ring
    wraps. Before this work the same step made 6 host reads of the positions, ~7.6 copies,
    6 stream waits and ~4.6 event queries per layer (count_stream_calls, 32 layers)."""
    L = 8
    res = C.count(layers=L, ctx=32 * 256 - 64, arena_pages=8 * 16 + 24, steps=3)
    per = res["per_step"]
    assert res["repartitions"] == 0, res                  # a steady split: its cost only
    assert res["streamed_pages_per_layer"] >= 12, res
    assert per["positions_host_reads"] == 1, per         # begin_forward's one read
    assert per.get("host_sync", 0) == 0, per              # nothing waits for the device
    # per layer: one fill (a physical page is its K and V page side by side; a second
    # where the ring wraps or the fill is split around the layer before) and one publish;
    # every table in one op per forward
    assert per["aten.copy_"] <= 3 * L + 2, per
    assert per.get("aten.arange", 0) == 0, per
    # per layer: a ready wait and the publish's wait for the compute; fills' waits for
    # consumed pages are implied by the publish waits that came before them
    assert per["stream_wait"] <= 2 * L, per
    # per layer: start and end of each fill group (two with split fills, CUDA's default)
    # and of the publish, and the consumed fence
    assert per["event_record"] <= 7 * L, per
    assert per["event_query"] <= 4, per                   # telemetry only, read lazily


class _F:
    def __init__(self, key, seq):
        self.stream_key, self.seq = key, seq


def test_latest_per_stream_keeps_the_last_fence_of_each_stream():
    rng = random.Random(SEED)
    for _ in range(200):
        keyed = [_F(rng.choice("abc"), s) for s in rng.sample(range(100), rng.randrange(8))]
        plain = [EventFence(), DONE]
        fences = keyed + plain + [plain[0]] + keyed[: rng.randrange(len(keyed) + 1)]
        rng.shuffle(fences)
        got = latest_per_stream(fences)
        want = {k: max((f for f in keyed if f.stream_key == k), key=lambda f: f.seq)
                for k in {f.stream_key for f in keyed}}
        assert sorted(id(f) for f in got) == sorted(
            [id(f) for f in want.values()] + [id(f) for f in plain]), SEED


def test_copy_engine_skips_only_waits_that_are_implied():
    fake = C.FakeCuda()
    with fake.active():
        be = C.fake_cuda_backend(fake)
        eng = be.copy_engine()
        src, dst = torch.arange(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
        f1, f2, f3 = be.compute_fence(), be.compute_fence(), be.compute_fence()
        side = C.fake_cuda_backend(fake)            # a second compute stream's fences
        fake.current = 55
        g1 = side.compute_fence()
        fake.current = fake.COMPUTE
        waited = []
        orig = fake.Stream.wait_event
        fake.Stream.wait_event = lambda s, ev: (waited.append(ev), orig(s, ev))
        note = CopyNote("fill", ())

        def copy(*after):
            waited.clear()
            eng.copy([(dst, src)], note, after=list(after))
            return list(waited)

        assert copy(f2, f1) == [f2.event]           # the later fence implies the earlier
        assert copy(f1) == []                       # already implied by f2
        own = copy(f3, g1)                          # other streams: each waited once
        assert sorted(map(id, own)) == sorted(map(id, [f3.event, g1.event]))
        mine = eng.copy([(dst, src)], note)
        assert copy(mine) == []                     # the copy stream's own fence: in order
        assert torch.equal(dst, src)
        # the compute side: a fence of its own stream is in order; the copy's is waited
        waited.clear()
        f3.device_wait()
        mine.device_wait()
        assert waited == [mine.event]


def test_harvest_and_readiness_miss_ask_the_device_little():
    fake = C.FakeCuda()
    with fake.active():
        be = C.fake_cuda_backend(fake)
        eng = be.copy_engine()
        be.compute_fence()                          # work on the compute stream first
        src, dst = torch.ones(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
        fences = [eng.copy([(dst, src)], CopyNote("fill", ())) for _ in range(5)]
        fake.counts.clear()
        assert eng.busy_s == 0.0                    # nothing finished: nothing counted
        assert fake.counts["event_query"] == 2      # the last, then the first: pending
        assert be.readiness_miss(fences) is False   # the compute stream is busy: no miss
        assert fake.counts["event_query"] == 2 and fake.counts["stream_query"] == 1
        assert be.readiness_miss([]) is False and fake.counts["stream_query"] == 1
        fake.idle_at = fences[2].event.tick         # compute and three copies done
        assert be.readiness_miss(fences) is True    # compute idle, copies pending: a miss
        assert eng.busy_s == pytest.approx(3 * 0.01 / 1000)
        fake.idle()
        fake.counts.clear()
        assert eng.busy_s == pytest.approx(5 * 0.01 / 1000)
        assert fake.counts["event_query"] == 1      # the last one done: all done
        assert fake.counts["event_elapsed"] == 2
        assert be.readiness_miss(fences) is False


CFG = ModelConfig(arch="llama", n_layers=4, hidden=128, ffn=128, n_heads=2, n_kv_heads=1,
                  head_dim=64, vocab_size=128, context_length=512)


@torch.inference_mode()
def _run(model, cache, prompt, n_decode, chunk=24):
    out = []
    for s in range(0, len(prompt), chunk):
        t = prompt[s:s + chunk]
        out.append(forward(model, cache, t, torch.arange(s, s + len(t)), last_only=True))
    ids = [int(out[-1][-1].argmax())]
    for p in range(len(prompt), len(prompt) + n_decode):
        out.append(forward(model, cache, torch.tensor(ids[-1:]), torch.tensor([p]),
                           last_only=True))
        ids.append(int(out[-1][-1].argmax()))
    return ids, torch.cat(out)


@pytest.mark.parametrize("pages", [17, 30])
def test_cuda_backend_code_on_the_cpu_is_bitwise_the_dense_cache(pages):
    """The CUDA backend's copy engine and fences (faked streams, CPU tensors) with a ring
    that wraps: bitwise the all-resident output, every page table checked at acquire."""
    torch.manual_seed(SEED)
    model = LlamaModel(CFG).eval()
    prompt = torch.randint(0, CFG.vocab_size, (150,),
                           generator=torch.Generator().manual_seed(SEED))
    ref = _run(model, KvStore(CFG, 256, 0, "q8_0", "q4_0", page_size=16), prompt, 10)
    fake = C.FakeCuda()
    with fake.active():
        kb, vb = (F.page_bytes(F.kv_type(t), 16, 1, 64) for t in ("q8_0", "q4_0"))
        mib = (align(pages * kb) + align(pages * vb)) / MIB
        cache = KvStore(CFG, 256, mib, "q8_0", "q4_0", page_size=16,
                                 backend=C.fake_cuda_backend(fake))
        cache.streamer.pool.check_plans = True
        got = _run(model, cache, prompt, 10)
        cache.close()
    assert got[0] == ref[0] and torch.equal(got[1], ref[1]), SEED
    assert cache.stats()["streamed_fraction"] > 0.3


def test_positions_are_checked_with_the_same_errors():
    cache = KvStore(CFG, 64, 1, page_size=16)
    with pytest.raises(ContextLengthError, match="position 64 is outside the KV cache of 64"):
        cache.begin_forward(torch.tensor([3, 64, 5]))
    with pytest.raises(ContextLengthError, match="position -1 is outside"):
        cache.begin_forward(torch.tensor([-1]))
    with pytest.raises(ContextLengthError, match="nothing to evaluate"):
        cache.begin_forward(torch.tensor([], dtype=torch.long))
    pos = torch.tensor([0, 1])
    cache.begin_forward(pos)
    cache.check_positions(pos)                       # the checked tensor: free
    with pytest.raises(ContextLengthError, match="position 70"):
        cache.check_positions(torch.tensor([70]))    # another tensor is still checked
    cache.end_forward(ok=False)
    with pytest.raises(ContextLengthError, match="position 64"):
        cache.check_positions(torch.tensor([64, 2]))
    # start=: the caller's ints stand for the tensor (checked where reading it is free)
    with pytest.raises(KvLayoutError, match="positions are not 1..2"):
        cache.begin_forward(torch.tensor([0, 1]), start=1)
    with pytest.raises(ContextLengthError, match="position 64 is outside"):
        cache.begin_forward(torch.arange(60, 65), start=60)
    cache.begin_forward(torch.tensor([0, 1]), start=0)
    assert cache.check_positions(torch.tensor([9, 3])) == (3, 9)
    cache.end_forward(ok=False)


def test_start_spares_the_last_host_read():
    res = C.count(layers=4, ctx=2048, arena_pages=4 * 4 + 10, steps=2, start=True)
    assert res["per_step"]["positions_host_reads"] == 0, res


def test_leased_pages_never_change_a_decision_that_keeps_the_split():
    """_apply_policy skips the leased-page scan unless the policy would accept a change:
    valid because leased pages only ever block a change."""
    rng = random.Random(SEED)
    kept = 0
    for _ in range(3000):
        L = rng.randrange(1, 6)
        cfg = P.PolicyConfig(L, rng.randrange(L * 2, 80), max_depth=rng.randrange(1, 4),
                             hysteresis_pages=rng.randrange(1, 3), patience=rng.randrange(1, 4))
        st = P.PolicyState(rng.randrange(-1, cfg.total_pages // L + 1), rng.randrange(1, 4),
                           rng.choice([None, rng.randrange(0, 20)]), rng.randrange(0, 4))
        obs = P.Observation(rng.randrange(1, cfg.total_pages + 1), rng.randrange(3),
                            rng.choice([None, rng.random()]), rng.random())
        leased = frozenset(rng.sample(range(cfg.total_pages), rng.randrange(cfg.total_pages)))
        free = P.step(cfg, st, obs)
        full = P.step(cfg, st, replace(obs, leased_pages=leased))
        if not free.accepted:
            kept += 1
            assert full == free, (SEED, cfg, st, obs)
        else:
            assert full.accepted or full.resident_per_layer == st.resident_per_layer
    assert kept > 100


def test_the_cache_scans_leases_only_for_a_change():
    cache = KvStore(CFG, 256, 0.16, page_size=16)   # 20 pages: splits change
    scans = []
    orig = cache.streamer.pool.leased_pages
    cache.streamer.pool.leased_pages = lambda: scans.append(1) or orig()
    torch.manual_seed(SEED)
    _run(LlamaModel(CFG).eval(), cache, torch.randint(0, CFG.vocab_size, (100,)), 6)
    changes = sum(s.repartitioned for s in cache.telemetry)
    assert changes >= 1 and len(scans) == changes, (len(scans), changes)


def test_copy_busy_counts_copies_that_land_after_the_host_moved_on():
    """With CUDA graphs the host ends a forward long before its copies run; the copy-busy
    share of a forward is settled at the next begin, over begin-to-begin time."""
    import time
    cfg = ModelConfig(arch="llama", n_layers=2, hidden=64, ffn=64, n_heads=1, n_kv_heads=1,
                      head_dim=64, vocab_size=16, context_length=4096)
    cache = KvStore(cfg, 1024, 1.0, k_type="q8_0", v_type="q4_0")
    rng = random.Random(SEED)

    def step(lo):
        cache.begin_forward(torch.arange(lo, lo + 1), start=lo)
        for layer in range(2):
            cache.layer(layer)
        cache.end_forward(True)

    step(0)
    first = cache.telemetry[-1].copy_busy_pct
    late = rng.uniform(0.02, 0.05)          # copy time that completes after end_forward
    cache.streamer.engine._busy_s += late
    time.sleep(2 * late)
    step(1)
    settled = cache.telemetry[0].copy_busy_pct
    # late / (begin-to-begin wall >= 2 * late): at most half, at least ~a fifth
    assert 20 < settled - first <= 50.5, (SEED, first, settled)
    assert cache.telemetry[1].copy_busy_pct <= 100.0


def test_decode_takes_its_split_once_though_the_host_runs_ahead(monkeypatch):
    """On CUDA the host runs ahead: at the first decode step the prefill's pages are still
    in use (leased). The change of phase to decode's smaller ring must not wait for a
    moment with nothing in flight (there is none while decoding: each step's leases were
    gathered, a query of every page's fence, and the split never changed): it drains once
    and switches; later steps keep the split without asking for leases."""
    L, ctx = 8, 32 * 256 - 64
    cfg = C.geometry(L)
    fake = C.FakeCuda()
    with fake.active():
        cache = KvStore(cfg, ctx + 64, C.arena_mib(cfg, L * 16 + 24), "q8_0", "q4_0",
                        backend=C.fake_cuda_backend(fake), decode_depth=1.5)  # (CUDA: 1.25)
        cache.plan(ctx + 16)
        model = C.ProtocolModel(cache.layers)
        tok = torch.zeros(1, dtype=torch.long)
        leases = []
        real = cache.streamer.pool.leased_pages
        cache.streamer.pool.leased_pages = lambda: (leases.append(1), real())[1]
        with torch.inference_mode():
            for s in range(0, ctx - 8, 2048):         # no host sync: the device lags
                n = min(2048, ctx - 8 - s)
                forward(model, cache, tok.expand(n), torch.arange(s, s + n))
            prefill_r = cache.streamer.pool.r
            for p in range(ctx - 8, ctx + 8):
                forward(model, cache, tok, torch.tensor([p]))
        cache.close()
    tel = cache.telemetry
    first = next(i for i, s in enumerate(tel) if s.tokens == 1)
    assert tel[first].repartitioned and "decode" in tel[first].policy, tel[first]
    assert cache.streamer.pool.r > prefill_r, (cache.streamer.pool.r, prefill_r)
    assert not any(s.repartitioned for s in tel[first + 1:]), tel[first + 1:]
    assert len(leases) <= 3, len(leases)
    assert sum(s.split_layers for s in tel[first + 1:]) > 0


@pytest.mark.parametrize("raw", [0.5, "deep", 9, True])
def test_a_bad_decode_depth_is_a_clear_error(raw):
    from kvcompile.engine.config import EngineConfig
    from kvcompile.errors import ArenaError
    from kvcompile.kv.streamer import decode_depth
    with pytest.raises(ArenaError, match="decode_depth"):
        decode_depth(raw, None)
    with pytest.raises(ArenaError, match="decode_depth"):
        EngineConfig.checked(decode_depth=raw)           # before any model loads
    assert decode_depth(1.75, None) == 1.75
    assert decode_depth("off", 1.25) is None and decode_depth("auto", 1.25) == 1.25
