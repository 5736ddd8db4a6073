"""Phase programs on the device: captured (compiled + CUDA graph) steps against the eager
model, the phase sequence with layouts that differ, and the decode pool of a fixed arena
from 8K to 256K context."""
from __future__ import annotations

import contextlib
import os
from dataclasses import replace

import pytest
import torch

from kvcompile.errors import ArenaError, PhaseError
from kvcompile.kv_cache import PagedKvCache
from kvcompile.loader import load_model
from kvcompile.make_model import make_model
from kvcompile.models.llama import LlamaModel
from kvcompile.phase import PhaseManager, attention_scratch_bytes, bucket_for
from kvcompile.phase.layouts import KV, WORKSPACE
from kvcompile.runtime.arena import MIB
from test_kv_cache import TINY, tiny_weights
from test_phase_manager import INDUCTOR_TOLERANCE

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def fresh_seed() -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    return seed


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("phase_llama") / "tiny.gguf"
    make_model("llama", "tiny", path, weight_type="f32", seed=fresh_seed() % 10_000)
    return path, load_model(str(path), device="cuda", progress=False)


@contextlib.contextmanager
def no_sync():
    """Any synchronising CUDA call inside raises (torch's sync debug mode)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@torch.inference_mode()
def eager(model, cache, ids, start, last_only=False, rows=None):
    """The model run directly (its own host checks), optionally on verify-padded rows."""
    n = len(ids)
    pad = (rows or n) - n
    tokens = torch.tensor(ids + ids[-1:] * pad, device="cuda")
    pos = torch.tensor(list(range(start, start + n)) + [start + n - 1] * pad, device="cuda")
    return model(tokens, pos, cache, last_only=last_only)[:n]


def relocate(cache, a: int, b: int) -> None:
    """Swap physical pages a and b (bytes and page-table entries) of every layer, in place:
    the logical KV is unchanged, its addresses are not."""
    for i in cache.layers:
        kv = cache.layer(i)
        for pool in (kv.k_pool, kv.v_pool):
            pool[[a, b]] = pool[[b, a]]
        t = kv.page_table
        la, lb = (t == a).nonzero().item(), (t == b).nonzero().item()
        t[la], t[lb] = b, a


def same_kv_twins(tiny, kv: str, lower: str):
    """(model, ids, ref cache, our cache, PhaseManager over ours): 600 random tokens
    prefilled eagerly into ref, then copied into ours, so both hold the same KV."""
    _, loaded = tiny
    model, cfg = loaded.model, loaded.config
    kt, vt = (kv, kv) if "/" not in kv else kv.split("/")
    ref = PagedKvCache(cfg, 2048, k_type=kt, v_type=vt, device="cuda")
    ours = PagedKvCache(cfg, 2048, k_type=kt, v_type=vt, device="cuda")
    torch._dynamo.reset()
    m = PhaseManager(model, ours, ubatch=256, lower=lower)
    g = torch.Generator().manual_seed(fresh_seed())
    ids = torch.randint(0, cfg.vocab_size, (700,), generator=g).tolist()
    eager(model, ref, ids[:600], 0)
    for i in ref.layers:
        ours.layer(i).k_pool.copy_(ref.layer(i).k_pool)
        ours.layer(i).v_pool.copy_(ref.layer(i).v_pool)
    return model, ids, ref, ours, m


@pytest.mark.parametrize("kv", ["f32", "q8_0/q4_0"])
def test_captured_decode_equals_eager_bitwise(tiny, kv):
    """Same KV in both caches; every decode step (widths 1, 2, 3 -> 4, 5 -> 8) through the
    captured program equals the eager model on the same rows bitwise, with pages relocated
    (page tables rewritten in place) between steps, and no synchronising call in a step."""
    model, ids, ref, ours, m = same_kv_twins(tiny, kv, "graph")
    pos, steps = 600, 0
    for w in [1, 1, 2, 3, 1, 5, 8, 1, 4, 1, 1]:
        step = ids[pos:pos + w]
        m.forward(step, pos)                         # the first use of a width captures
        torch.cuda.synchronize()
        relocate(ref, steps % 3, 3 + steps % 5)
        relocate(ours, steps % 3, 3 + steps % 5)
        want = eager(model, ref, step, pos, rows=bucket_for(w))
        # the replay: same step again (idempotent KV writes), no sync allowed inside
        with no_sync():
            got = m.forward(step, pos)
        assert torch.equal(got, want), f"width {w} at {pos}: max diff {(got - want).abs().max()}"
        pos, steps = pos + w, steps + 1
    for i in ref.layers:
        assert torch.equal(ours.layer(i).k_pool, ref.layer(i).k_pool)
        assert torch.equal(ours.layer(i).v_pool, ref.layer(i).v_pool)
    print(kv, m.stats())
    assert m.captures == 4 and m.transitions == 1     # decode/1, /2, /4, /8, one layout


@pytest.mark.parametrize("kv", ["f32", "q8_0/q4_0"])
def test_inductor_captured_decode_matches_eager(tiny, kv):
    """The opt-in lower="inductor": the pass pipeline's graph fused by inductor,
    then captured. Fused reductions and FMAs round differently, so not bitwise: every step
    within float noise of the eager model on the same KV (test_phase_manager's tolerance)."""
    model, ids, ref, ours, m = same_kv_twins(tiny, kv, "inductor")
    pos, worst = 600, 0.0
    for w in [1, 1, 2, 1, 5, 8, 1]:
        step = ids[pos:pos + w]
        want = eager(model, ref, step, pos, rows=bucket_for(w))
        m.forward(step, pos)                         # the first use of a width captures
        with no_sync():                              # the replay: no sync inside a step
            got = m.forward(step, pos)
        err = ((got - want).abs().max() / want.abs().max()).item()
        worst = max(worst, err)
        assert err < INDUCTOR_TOLERANCE[kv], f"width {w} at {pos}: relative max |dlogit| {err}"
        pos += w
    print(kv, "inductor vs eager: worst relative max |dlogit|", worst, m.stats()["lower"])


def test_captured_prefill_equals_eager_bitwise(tiny):
    _, loaded = tiny
    model, cfg = loaded.model, loaded.config
    ref = PagedKvCache(cfg, 1024, k_type="q8_0", v_type="q4_0", device="cuda")
    ours = PagedKvCache(cfg, 1024, k_type="q8_0", v_type="q4_0", device="cuda")
    torch._dynamo.reset()
    m = PhaseManager(model, ours, ubatch=128, lower="graph")
    ids = torch.randint(0, cfg.vocab_size, (384,),
                        generator=torch.Generator().manual_seed(fresh_seed())).tolist()
    for start in range(0, 384, 128):
        got = m.forward(ids[start:start + 128], start)
        want = eager(model, ref, ids[start:start + 128], start, last_only=True)
        assert torch.equal(got, want), f"chunk at {start}: max diff {(got - want).abs().max()}"
    assert m.captures == 1 and m.programs[("prefill", 128)].replays == 3


def test_phase_sequence_with_layouts_that_differ(tiny):
    """prefill -> decode -> a new request's prefill -> decode. Each transition re-places the
    workspace (kv stays put), the old layout's programs are parked (they raise) and come back
    when their layout does; outputs equal the eager model; the Engine option gives the same
    tokens."""
    path, loaded = tiny
    model, cfg = loaded.model, loaded.config
    ref = PagedKvCache(cfg, 1024, device="cuda")
    ours = PagedKvCache(cfg, 1024, device="cuda")
    torch._dynamo.reset()
    m = PhaseManager(model, ours, ubatch=64, lower="graph")
    g = torch.Generator().manual_seed(fresh_seed())
    layouts, stale = [], []
    for request in range(2):
        ids = torch.randint(0, cfg.vocab_size, (100,), generator=g).tolist()
        ref.reset(), ours.reset()
        got = m.forward(ids[:64], 0)
        assert torch.equal(got, eager(model, ref, ids[:64], 0, last_only=True))
        layouts.append(("prefill", m.arena.region(KV), m.arena.region(WORKSPACE)))
        stale.append(m.programs[("prefill", 64)])
        pos = 64
        for w in ([1, 1, 1] if request == 0 else [1, 2, 1]):
            got = m.forward(ids[pos:pos + w], pos)
            assert torch.equal(got, eager(model, ref, ids[pos:pos + w], pos))
            pos += w
        layouts.append(("decode", m.arena.region(KV), m.arena.region(WORKSPACE)))
        stale.append(m.programs[("decode", 1)])
    stats = m.stats()
    print("phase stats", stats)
    for phase, kv, ws in layouts:
        print(f"{phase:8s} kv @{kv.offset} {kv.size} B (gen {kv.generation}), workspace "
              f"@{ws.offset} {ws.size} B (gen {ws.generation})")
    assert len({kv for _, kv, _ in layouts}) == 1                   # kv never moved
    assert len({ws.generation for _, _, ws in layouts}) == 4         # re-placed every time
    assert layouts[0][2].size != layouts[1][2].size
    assert m.kv_pool_bytes("prefill") < m.kv_pool_bytes("decode")
    # p/64 d/1 | (both back at the same addresses) d/2: the second request captured once
    assert m.captures == 3 and m.transitions == 4 and m.revived == 2
    assert stale[0] is stale[2] and stale[1] is stale[3]
    with pytest.raises(PhaseError, match="parked"):      # prefill's, in the decode layout
        stale[0].run([1] * stale[0].rows, [0] * stale[0].rows)

    from kvcompile.engine import Engine
    plain = Engine(str(path), ctx_size=1024, device="cuda", dtype="f32", progress=False,
                   cuda_graphs=False)
    graphs = Engine(str(path), ctx_size=1024, device="cuda", dtype="f32", progress=False,
                    cuda_graphs=True)
    prompt = "a lighthouse keeper wrote that the storm " * 4
    for _ in range(2):
        a = plain.generate(prompt, max_tokens=48, temperature=0)
        b = graphs.generate(prompt, max_tokens=48, temperature=0)
        print(f"decode tok/s eager {a.decode_tok_s:.0f}, captured {b.decode_tok_s:.0f}; "
              f"{graphs.phases.stats()}")
        assert a.token_ids == b.token_ids


def test_decode_pool_flat_on_a_fixed_arena_from_8k_to_256k():
    """A fixed 512 MiB arena, q8_0/q4_0 KV all resident: the measured workspace of the
    captured decode programs and the decode KV pool do not depend on the context."""
    cfg = replace(TINY, context_length=262144)
    model = LlamaModel.from_weights(
        cfg, tiny_weights(cfg, torch.Generator().manual_seed(fresh_seed())), device="cuda")
    arena = 512 * MIB
    rows = []
    print(f"{'ctx':>7} {'kv MiB':>8} {'prefill pool MiB':>17} {'decode pool MiB':>16} "
          f"{'decode ws (measured) MiB':>25} {'prefill ws (measured) MiB':>26}")
    for ctx in (8192, 16384, 32768, 65536, 131072, 262144):
        cache = PagedKvCache(cfg, ctx, k_type="q8_0", v_type="q4_0", device="cuda")
        torch._dynamo.reset()
        m = PhaseManager(model, cache, ubatch=64, arena_bytes=arena)
        ids = list(range(1, 80))
        m.forward(ids[:64], 0)
        prefill_ws = m.programs[("prefill", 64)].workspace
        for w in (1, 8):
            m.forward(ids[64:64 + w], 64)
        decode_ws = max(p.workspace for p in m.programs.values())
        r = (ctx, m.kv_bytes, m.kv_pool_bytes("prefill"), m.kv_pool_bytes("decode"), decode_ws,
             prefill_ws)
        rows.append(r)
        print(f"{ctx:>7} {r[1] / MIB:>8.1f} {r[2] / MIB:>17.1f} {r[3] / MIB:>16.1f} "
              f"{r[4] / MIB:>25.3f} {r[5] / MIB:>26.3f}")
        del m, cache
        torch.cuda.empty_cache()
    pools = [r[3] for r in rows]
    assert max(pools) / min(pools) <= 1.02
    assert max(r[4] for r in rows) <= 1.02 * min(r[4] for r in rows)
    assert all(r[2] < r[3] for r in rows)


def test_arena_too_small_for_a_captured_programs_workspace(tiny):
    """The layout reserves 512 bytes of activations for decode: the capture measures more."""
    _, loaded = tiny
    cache = PagedKvCache(loaded.config, 512, device="cuda")
    torch._dynamo.reset()
    from kvcompile.ops.span_attention.launch import num_sms
    scratch = attention_scratch_bytes(loaded.config, num_sms(torch.device("cuda")))
    m = PhaseManager(loaded.model, cache, ubatch=64, workspace_bytes={"decode": scratch + 512})
    with pytest.raises(ArenaError, match=r"decode/1 needs .* MiB of workspace but its layout "
                                         r"reserves 0.00 MiB"):
        m.forward([1], 0)
    assert not m.programs[("decode", 1)].valid
