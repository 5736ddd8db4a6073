"""Arena: transactions, leases with completion fences, views, and too-small errors."""
from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch

from kvcompile.models.config import ModelConfig
from kvcompile.errors import ArenaError, KvcompileError
from kvcompile.kv.store import KvStore, min_arena_bytes
from kvcompile.kv.arena import ALIGN, MIB, Arena
from kvcompile.kv.fences import EventFence
from kvcompile.kv.kv_pages import PagePair, page_bytes

SEED = int.from_bytes(os.urandom(4), "little")


def test_reserve_commit_places_disjoint_aligned_regions():
    rng = random.Random(SEED)
    a = Arena(1 * MIB)
    sizes = {f"r{i}": rng.randrange(1, 100_000) for i in range(6)}
    with a.begin() as tx:
        for n, s in sizes.items():
            tx.reserve(n, s)
    spans = sorted((r.offset, r.offset + r.size) for r in a.regions().values())
    assert all(off % ALIGN == 0 for off, _ in spans), SEED
    assert all(e0 <= s1 for (_, e0), (s1, _) in zip(spans, spans[1:])), SEED
    assert spans[-1][1] <= a.nbytes
    assert {n: r.size for n, r in a.regions().items()} == sizes


def test_views_alias_the_arena_without_copies():
    a = Arena(MIB)
    with a.begin() as tx:
        tx.reserve("x", 4096).reserve("y", 4096)
    data = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    a.view("x").copy_(data)
    assert torch.equal(a.buffer[a.region("x").offset:][:4096], data)
    part = a.view("x", 1024, 512)
    assert part.data_ptr() == a.buffer.data_ptr() + a.region("x").offset + 1024
    part.zero_()
    assert int(a.view("x")[1024:1536].sum()) == 0 and torch.equal(a.view("x")[:1024], data[:1024])
    with pytest.raises(ArenaError, match="outside region"):
        a.view("y", 4000, 200)
    with pytest.raises(ArenaError, match="no region"):
        a.view("z")


def test_abort_leaves_the_old_map_and_views_intact():
    a = Arena(MIB)
    with a.begin() as tx:
        tx.reserve("kv", 300_000).reserve("ws", 100_000)
    before, epoch = a.regions(), a.epoch
    tx = a.begin().reserve("kv", 600_000).drop("ws").reserve("new", 1000)
    tx.abort()
    assert a.regions() == before and a.epoch == epoch
    with pytest.raises(ArenaError):
        tx.commit()
    with pytest.raises(RuntimeError):   # an exception inside `with` aborts too
        with a.begin() as tx:
            tx.reserve("kv", 10)
            raise RuntimeError("boom")
    assert a.regions() == before


def test_unchanged_regions_keep_their_place_moved_views_go_stale():
    a = Arena(MIB)
    with a.begin() as tx:
        tx.reserve("weights_ws", 200_000).reserve("kv", 300_000)
    kv, ws = a.region("kv"), a.region("weights_ws")
    with a.begin() as tx:
        tx.reserve("weights_ws", 500_000)      # grows: moves; kv keeps its offset
    assert a.region("kv") == kv and a.is_current(kv)
    assert not a.is_current(ws)
    with pytest.raises(ArenaError, match="moved"):
        a._slice(ws, 0, None)


def test_commit_refuses_to_move_a_leased_region():
    a = Arena(MIB)
    with a.begin() as tx:
        tx.reserve("ring", 100_000)
    lease = a.lease("ring")
    before = a.regions()
    with pytest.raises(ArenaError, match="still leased"):
        a.begin().reserve("ring", 200_000).commit()
    with pytest.raises(ArenaError, match="still leased"):
        a.begin().drop("ring").commit()
    assert a.regions() == before
    with a.begin() as tx:                       # other regions may change meanwhile
        tx.reserve("ws", 50_000)
    assert lease.view().numel() == 100_000
    lease.release()
    with pytest.raises(ArenaError, match="released"):
        lease.view()
    a.begin().reserve("ring", 200_000).commit()
    assert a.region("ring").size == 200_000


def test_commit_waits_for_the_completion_fence_of_a_released_lease():
    a = Arena(MIB)
    with a.begin() as tx:
        tx.reserve("ring", 100_000)
    fence = EventFence("device still reading")
    a.lease("ring").release(fence)              # lease gone, device work still pending
    delay = 0.05 + random.Random(SEED).random() * 0.05
    threading.Timer(delay, fence.set).start()
    t0 = time.perf_counter()
    a.begin().drop("ring").commit()
    assert fence.query() and time.perf_counter() - t0 >= delay * 0.9, SEED
    assert "ring" not in a.regions()


def test_too_small_arena_names_the_smallest_that_works():
    a = Arena(MIB)
    tx = a.begin().reserve("kv", MIB + 1)
    with pytest.raises(ArenaError, match=r"at least 2 MiB"):
        tx.commit()
    assert a.regions() == {}
    Arena(2 * MIB).begin().reserve("kv", MIB + 1).commit()   # the named size works
    with pytest.raises(ArenaError):
        Arena(0)


CFG = ModelConfig(arch="llama", n_layers=4, hidden=128, ffn=256, n_heads=4, n_kv_heads=2,
                  head_dim=64, vocab_size=256, context_length=4096)


@pytest.mark.parametrize("types", [("f32", "f32"), ("q8_0", "q4_0")])
def test_streaming_cache_too_small_names_the_minimum_in_mib(types):
    tokens = random.Random(SEED).randrange(2000, 4000)
    need = min_arena_bytes(CFG, tokens, *types, page_size=256)
    too_small = (need - 1) / MIB
    with pytest.raises(ArenaError, match=r"--kv-stream-arena-mib (\d+)") as e:
        KvStore(CFG, tokens, arena_mib=too_small, k_type=types[0], v_type=types[1])
    assert isinstance(e.value, KvcompileError)
    named = int(str(e.value).split("--kv-stream-arena-mib ")[1].split()[0])
    cache = KvStore(CFG, tokens, arena_mib=named, k_type=types[0], v_type=types[1])
    assert cache.streamer.pool.P >= cache.num_pages
    with pytest.raises(ArenaError):
        KvStore(CFG, tokens, arena_mib=named - 1 if named > 1 else 0.01,
                         k_type=types[0], v_type=types[1])


@pytest.mark.parametrize("types", [("q8_0", "q8_0"), ("q8_0", "q4_0"), ("f16", "f32")])
def test_every_arena_from_the_minimum_up_serves_its_context(types):
    """Arenas of any byte count (not multiples of the arena's alignment), small pages (one
    16-position page pair is not a multiple of 256 bytes): the minimum and every size past
    it build, with at least the context's pages."""
    cfg = ModelConfig(arch="llama", n_layers=2, hidden=64, ffn=128, n_heads=1, n_kv_heads=1,
                      head_dim=64, vocab_size=64, context_length=2048)
    rng = random.Random(SEED)
    tokens = rng.randrange(500, 1500)
    need = min_arena_bytes(cfg, tokens, *types, page_size=16)
    stride = PagePair(*page_bytes(cfg, *types, 16)).stride
    # just past a whole number of page pairs: their region, aligned, may not fit
    extras = [0] + [k * stride + rng.randrange(ALIGN // 2) for k in (1, 2, 3)]
    for extra in extras + [rng.randrange(1, 16 * ALIGN) for _ in range(4)]:
        cache = KvStore(cfg, tokens, arena_mib=(need + extra) / MIB, k_type=types[0],
                                 v_type=types[1], page_size=16)
        assert cache.streamer.pool.P >= cache.num_pages, (SEED, extra)
        cache.close()


def test_closing_a_streaming_cache_releases_its_regions():
    cache = KvStore(CFG, 512, arena_mib=2, page_size=256)
    a = cache.arena
    assert a.leased("kv")
    with pytest.raises(ArenaError, match="still leased"):
        a.begin().drop("kv").commit()
    cache.close()
    assert not a.leased("kv")
    a.begin().drop("kv").reserve("workspace", MIB).commit()
    assert set(a.regions()) == {"workspace"}


def test_allocation_failures_are_clear_errors_and_leave_the_process_usable():
    from kvcompile.kv.backend import CpuBackend
    with pytest.raises(ArenaError, match="cannot allocate an arena"):
        KvStore(CFG, 512, arena_mib=2 ** 31, page_size=256)   # 2 PiB
    with pytest.raises(ArenaError, match="host KV history"):
        CpuBackend().host_buffer((2 ** 40, 2 ** 20))
    cache = KvStore(CFG, 512, arena_mib=2, page_size=256)
    assert cache.streamer.pool.P >= cache.num_pages
