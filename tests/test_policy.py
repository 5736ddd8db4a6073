"""Policy: a pure step(config, state, observation) -> decision; bounds, hysteresis, leases."""
from __future__ import annotations

import os
import random
from dataclasses import replace

import pytest

from kvcompile.errors import ArenaError
from kvcompile.kv.policy import (Observation, PolicyConfig, PolicyState,
                                      changed_pages, serves, step, target_split)

SEED = int.from_bytes(os.urandom(4), "little")


def _cfg(rng, **kw):
    return PolicyConfig(n_layers=rng.randrange(2, 40), total_pages=rng.randrange(8, 3000), **kw)


def test_split_bounds_on_random_geometries():
    rng = random.Random(SEED)
    for _ in range(500):
        cfg = _cfg(rng, max_depth=rng.randrange(1, 4), headroom_pages=rng.randrange(0, 3))
        ctx = rng.randrange(1, cfg.total_pages + 1)
        for depth in range(1, cfg.max_depth + 1):
            r = target_split(cfg, ctx, depth)
            msg = (SEED, cfg, ctx, depth, r)
            assert 0 <= r and cfg.n_layers * r <= cfg.total_pages, msg
            assert serves(cfg, r, ctx), msg          # the ring holds one layer's stream
            if cfg.n_layers * (ctx + cfg.headroom_pages) <= cfg.total_pages:
                assert r >= ctx, msg                 # everything fits: nothing streams
            else:
                # maximal: one more resident page per layer breaks the depth's ring need
                # (or the single-layer need when even depth 1 does not fit with headroom)
                c = ctx + cfg.headroom_pages
                k = next((k for k in range(min(depth, cfg.n_layers - 1), 0, -1)
                          if cfg.total_pages - cfg.n_layers * r >= k * (c - r)), None)
                if k is not None and r < c:
                    assert cfg.total_pages - cfg.n_layers * (r + 1) < k * (c - r - 1), msg


def test_deeper_lookahead_never_keeps_more_resident():
    rng = random.Random(SEED + 1)
    for _ in range(300):
        cfg = _cfg(rng, max_depth=3)
        ctx = rng.randrange(1, cfg.total_pages + 1)
        rs = [target_split(cfg, ctx, d) for d in (1, 2, 3)]
        assert rs[0] >= rs[1] >= rs[2], (SEED, cfg, ctx, rs)


def test_context_beyond_the_arena_is_an_arena_error():
    cfg = PolicyConfig(n_layers=4, total_pages=10)
    with pytest.raises(ArenaError, match="kv-stream-arena-mib"):
        step(cfg, PolicyState(), Observation(context_pages=11))


def test_first_step_is_forced_and_accepted():
    cfg = PolicyConfig(n_layers=8, total_pages=100, max_depth=2)
    d = step(cfg, PolicyState(depth=2), Observation(context_pages=30))
    assert d.accepted and "forced" in d.reason
    assert d.resident_per_layer == target_split(cfg, 30, 2)
    assert d.ring_slots == 100 - 8 * d.resident_per_layer


def _settle(cfg, ctx, depth=1):
    d = step(cfg, PolicyState(depth=depth), Observation(context_pages=ctx))
    assert d.accepted
    return d.state


def test_hysteresis_needs_patience_and_a_big_enough_change():
    rng = random.Random(SEED + 2)
    cfg = PolicyConfig(n_layers=10, total_pages=400, max_depth=2, patience=rng.randrange(2, 6),
                       hysteresis_pages=2)
    state = _settle(cfg, 60, depth=1)
    r0 = state.resident_per_layer
    # Misses with a copy engine that has slack ask for depth 2: a smaller resident share.
    miss = Observation(context_pages=60, readiness_misses=3, ring_occupancy=1.0, copy_busy=0.3)
    target = target_split(cfg, 60, 2)
    assert r0 - target >= cfg.hysteresis_pages
    for i in range(cfg.patience - 1):
        d = step(cfg, state, miss)
        assert not d.accepted and d.resident_per_layer == r0, (SEED, i, d)
        state = d.state
    d = step(cfg, state, miss)
    assert d.accepted and d.resident_per_layer == target, (SEED, d)
    # A proposal interrupted by a step that wants the current split starts over
    # (a ring mostly idle without misses: less lookahead will do).
    state = _settle(cfg, 60, depth=1)
    back = Observation(context_pages=60, readiness_misses=0, ring_occupancy=0.1)
    for obs in [miss] * (cfg.patience - 1) + [back] + [miss] * (cfg.patience - 1):
        d = step(cfg, state, obs)
        assert not d.accepted, (SEED, d)
        state = d.state


def test_small_changes_are_ignored():
    cfg = PolicyConfig(n_layers=10, total_pages=400, hysteresis_pages=3, patience=1,
                       headroom_pages=0)
    state = _settle(cfg, 60)
    r0 = state.resident_per_layer
    for ctx in range(60, 64):                   # context growth moves the target a little
        d = step(cfg, state, Observation(context_pages=ctx, ring_occupancy=0.9))
        if abs(target_split(cfg, ctx, d.state.depth) - r0) < 3:
            assert not d.accepted and d.resident_per_layer == r0, d
        state = d.state


def test_forced_change_skips_hysteresis_when_the_ring_cannot_serve():
    cfg = PolicyConfig(n_layers=10, total_pages=400, patience=50, hysteresis_pages=100)
    state = _settle(cfg, 30)                    # everything resident, no ring
    assert state.resident_per_layer == 40
    d = step(cfg, state, Observation(context_pages=80, ring_occupancy=0.0))
    assert not serves(cfg, 40, 80) and d.accepted and "forced" in d.reason
    assert serves(cfg, d.resident_per_layer, 80)


def test_depth_feedback():
    cfg = PolicyConfig(n_layers=10, total_pages=400, max_depth=3)
    s = PolicyState(resident_per_layer=10, depth=2)
    up = step(cfg, s, Observation(50, readiness_misses=1, ring_occupancy=1.0, copy_busy=0.5))
    saturated = step(cfg, s, Observation(50, readiness_misses=4, ring_occupancy=1.0,
                                         copy_busy=0.99))
    idle = step(cfg, s, Observation(50, readiness_misses=0, ring_occupancy=0.1))
    steady = step(cfg, s, Observation(50, readiness_misses=0, ring_occupancy=0.9))
    first = step(cfg, s, Observation(50))       # no feedback yet
    assert (up.state.depth, saturated.state.depth, idle.state.depth, steady.state.depth,
            first.state.depth) == (3, 2, 1, 2, 2)   # saturated: PCIe-bound, depth stays
    top = step(cfg, PolicyState(10, depth=3), Observation(50, 1, 1.0, 0.1))
    bottom = step(cfg, PolicyState(10, depth=1), Observation(50, 0, 0.0, 0.99))
    assert top.state.depth == 3 and bottom.state.depth == 1


def test_never_repartitions_onto_a_leased_page():
    rng = random.Random(SEED + 3)
    for _ in range(200):
        cfg = _cfg(rng, patience=1, hysteresis_pages=1, max_depth=2)
        ctx = rng.randrange(1, cfg.total_pages + 1)
        cur = rng.randrange(0, cfg.total_pages // cfg.n_layers + 1)
        leased = frozenset(rng.sample(range(cfg.total_pages), rng.randrange(0, 6)))
        state = PolicyState(resident_per_layer=cur, depth=rng.randrange(1, 3))
        obs = Observation(ctx, rng.randrange(0, 2), rng.random(), rng.random(), leased)
        d = step(cfg, state, obs)
        free = step(cfg, state, Observation(ctx, obs.readiness_misses, obs.ring_occupancy,
                                            obs.copy_busy))
        msg = (SEED, cfg, cur, ctx, sorted(leased), d)
        if d.accepted:
            assert not set(changed_pages(cfg, cur, d.resident_per_layer)) & leased, msg
            assert serves(cfg, d.resident_per_layer, ctx), msg
        else:
            assert d.resident_per_layer == cur, msg
        if "leased" in d.reason:     # blocked only because a leased page would move
            assert free.accepted, msg
            assert set(changed_pages(cfg, cur, free.resident_per_layer)) & leased, msg
        else:
            assert (d.accepted, d.resident_per_layer) == (free.accepted, free.resident_per_layer)


def test_step_is_pure():
    cfg = PolicyConfig(n_layers=6, total_pages=120)
    s = PolicyState(resident_per_layer=5, depth=2, pending=3, streak=1)
    obs = Observation(40, 2, 0.7, 0.4, frozenset({1, 2}))
    assert step(cfg, s, obs) == step(cfg, s, obs)
    assert s == PolicyState(resident_per_layer=5, depth=2, pending=3, streak=1)


def test_a_saturated_copy_engine_never_flips_the_split():
    """PCIe-bound decode (copy engine ~busy, attention waiting on copies) keeps its split:
    the old rule dropped to depth 1 there and flipped back on the next misses, a drain each
    time (seen on the H200 at 128K/256K context)."""
    cfg = PolicyConfig(n_layers=16, total_pages=5513)
    state = _settle(cfg, 1025, depth=2)
    r0 = state.resident_per_layer
    rng = random.Random(SEED + 9)
    for i in range(30):
        obs = Observation(1025, readiness_misses=rng.randrange(0, 6),
                          ring_occupancy=1.0, copy_busy=rng.uniform(0.9, 1.0))
        d = step(cfg, state, obs)
        assert not d.accepted and d.state.depth == 2, (SEED, i, d)
        state = d.state
    assert state.resident_per_layer == r0


def test_a_planned_request_keeps_one_split_as_its_context_grows():
    """A request that names the context it will reach (prompt + max tokens) gets that
    context's split at its first forward and keeps it through prefill chunks and decode
    steps: no repartition (a drain each) while the context grows, whatever the feedback."""
    rng = random.Random(SEED + 11)
    for _ in range(50):
        L = rng.randrange(2, 40)
        planned = rng.randrange(2, 300)
        cfg = PolicyConfig(n_layers=L, total_pages=rng.randrange(planned + 1, 3 * L * planned),
                           min_depth=2)
        d = step(cfg, PolicyState(depth=2), Observation(1, planned_pages=planned))
        assert d.accepted and d.resident_per_layer == target_split(cfg, planned, 2), SEED
        state, splits = d.state, set()
        ctx = 1
        while ctx < planned:
            ctx = min(planned, ctx + rng.randrange(1, 4))
            obs = Observation(ctx, rng.randrange(0, 3), rng.uniform(0, 1), rng.uniform(0, 1),
                              planned_pages=planned)
            d = step(cfg, state, obs)
            assert not d.accepted and serves(cfg, d.resident_per_layer, ctx), (SEED, ctx, d)
            state = d.state
            splits.add(d.resident_per_layer)
        assert len(splits) <= 1 and state.depth == 2, (SEED, splits)


def test_min_depth_holds_the_lookahead():
    cfg = PolicyConfig(n_layers=10, total_pages=400, max_depth=3, min_depth=2)
    idle = step(cfg, PolicyState(10, depth=2), Observation(50, 0, 0.0, 0.1))
    assert idle.state.depth == 2
    plain = step(replace(cfg, min_depth=1), PolicyState(10, depth=2), Observation(50, 0, 0.0, 0.1))
    assert plain.state.depth == 1


def test_decode_steps_take_a_fractional_ring_at_once_and_prefill_takes_its_own_back():
    """decode_depth: a decode step gets the split whose ring holds that many layers of
    stream (the largest such r), at once (a change of phase waits out no patience), keeps
    it while decoding, and the next prefill gets the depth-2 split back at once."""
    rng = random.Random(SEED + 12)
    checked = 0
    for _ in range(200):
        L = rng.randrange(3, 40)
        planned = rng.randrange(4, 300)
        dd = rng.choice([1.1, 1.25, 1.5])
        cfg = PolicyConfig(n_layers=L, total_pages=rng.randrange(planned + 1, 2 * L * planned),
                           min_depth=2, decode_depth=dd)
        c = planned + cfg.headroom_pages
        pre = step(cfg, PolicyState(depth=2), Observation(planned, planned_pages=planned))
        dec = step(cfg, pre.state, Observation(planned, planned_pages=planned, decode=True))
        r_p, r_d = pre.resident_per_layer, dec.resident_per_layer
        msg = (SEED, cfg, planned, r_p, r_d)
        assert r_d == max(target_split(cfg, planned, dd), r_p), msg
        assert serves(cfg, r_d, planned), msg
        assert dec.accepted == (r_d != r_p) and dec.state.decode, msg
        if r_d != r_p:         # blocked by a leased page: not taken, but the caller must
            leased = frozenset(changed_pages(cfg, r_p, r_d)[:1])    # drain and ask again
            held = step(cfg, pre.state, Observation(planned, planned_pages=planned,
                                                    decode=True, leased_pages=leased))
            assert not held.accepted and held.urgent and not held.state.decode, msg
        if (L * c > cfg.total_pages and r_p < r_d < c
                and cfg.total_pages - L * r_d >= dd * (c - r_d)):
            checked += 1       # maximal: one more resident page breaks the ring's need
            assert cfg.total_pages - L * (r_d + 1) < dd * (c - r_d - 1), msg
        again = step(cfg, dec.state, Observation(planned, 0, 0.5, 0.95, planned_pages=planned,
                                                 decode=True))
        assert not again.accepted and again.resident_per_layer == r_d, msg
        back = step(cfg, again.state, Observation(planned, planned_pages=planned))
        assert back.resident_per_layer == r_p and back.accepted == (r_d != r_p), msg
    assert checked > 20, (SEED, checked)
