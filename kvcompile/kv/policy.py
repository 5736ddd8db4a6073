"""Adaptive resident/ring split: a pure function step(config, state, observation) -> decision.

The physical budget (pages of the arena's KV regions) is split into resident pages (a
prefix of r logical pages of every streamed layer) and one ring shared by all layers.
Bytes over PCIe are the currency, so r is as large as possible while the ring can still
hold `depth` layers' worth of streamed pages (depth 1: no overlap; 2: the next layer's copy
runs while this layer computes). Feedback moves depth: readiness misses while the copy
engine has slack ask for more lookahead; a ring mostly idle with no misses gives pages back
to the resident side. A saturated copy engine keeps the depth: going back to depth 1 would
save a few percent of the bytes (one layer's ring share becomes resident) but serialises
each layer's copy behind the previous layer's attention, which costs more than it saves
(measured on the H200: the split flipped between 1 and 2 every few steps, each flip a
drain; the streaming cache therefore keeps depth >= 2 with `min_depth`). Decode steps are
another matter: their compute per layer is short, so with split fills (kv/pool.py) a
ring of one layer's stream plus a margin that lands during that compute keeps the copy
engine busy: `decode_depth` (e.g. 1.5 layers) is the depth of forwards of few rows, and
a change of phase (prefill <-> decode) is taken at once, without patience. A request that
says how far it will grow (`planned_pages`: prompt + max tokens) gets the split for that
context at its first forward, so prefill and decode run on one split. Hysteresis: a new split is accepted only when it differs by at least
`hysteresis_pages` per layer and was proposed `patience` steps in a row -- unless the
current split cannot serve the next forward at all (forced). A change that would hand a
still-leased page to another role is never accepted; the caller drains and asks again.
"""
from __future__ import annotations

import functools
import math
from fractions import Fraction
from dataclasses import dataclass, field, replace

from kvcompile.errors import ArenaError

DECODE_ROWS = 8   # a forward of at most this many rows is a decode or verify step


@dataclass(frozen=True)
class PolicyConfig:
    n_layers: int
    total_pages: int              # physical pages of the arena's KV regions
    max_depth: int = 2
    min_depth: int = 1
    decode_depth: float | None = None  # ring depth (in layers) of decode steps; None: depth
    headroom_pages: int = 1       # growth room so decode does not repartition at each page
    hysteresis_pages: int = 1
    patience: int = 3
    busy_high: float = 0.9        # copy engine busy fraction considered saturated
    occupancy_low: float = 0.5


@dataclass(frozen=True)
class PolicyState:
    resident_per_layer: int = -1  # -1: no split yet
    depth: int = 1
    pending: int | None = None    # proposed r waiting out the hysteresis
    streak: int = 0
    decode: bool = False          # the split was made for decode steps (decode_depth)


@dataclass(frozen=True)
class Observation:
    context_pages: int            # logical pages per layer the next forward reads
    readiness_misses: int = 0     # waits on incomplete copies during the last step
    ring_occupancy: float | None = None  # peak fraction of ring slots in use last step
    copy_busy: float = 0.0        # fraction of the last step the copy engine was busy
    # (ring_occupancy None: no previous step to learn from, depth stays)
    leased_pages: frozenset = field(default_factory=frozenset)  # physical pages still in use
    planned_pages: int = 0        # pages the request will reach (its prompt + max tokens):
    # the split is made for these from the start, so it need not change as the context grows
    decode: bool = False          # the next forward is a decode (or verify) step: few rows


@dataclass(frozen=True)
class Decision:
    state: PolicyState
    accepted: bool                # True: repartition to resident_per_layer now
    resident_per_layer: int
    ring_slots: int
    reason: str
    urgent: bool = False          # not accepted only because of leases, but it must not
    #                               wait (forced, or a change of phase): drain, ask again


def ring_slots(cfg: PolicyConfig, r: int) -> int:
    return cfg.total_pages - cfg.n_layers * r


def serves(cfg: PolicyConfig, r: int, context_pages: int) -> bool:
    """Can split r run a forward over context_pages (the ring holds one layer's stream)?"""
    return r >= 0 and ring_slots(cfg, r) >= max(context_pages - r, 0)


@functools.lru_cache(maxsize=256)   # asked at every step; Fraction arithmetic is slow
def target_split(cfg: PolicyConfig, context_pages: int, depth: float) -> int:
    """Largest r whose ring holds `depth` (maybe a fraction) layers of streamed pages, with
    headroom; fewer layers (whole ones) where that cannot be."""
    L, P = cfg.n_layers, cfg.total_pages
    if P < context_pages:
        raise ArenaError(f"the arena's KV space holds {P} pages but one layer's context needs "
                         f"{context_pages}; raise --kv-stream-arena-mib or lower --ctx-size")
    c = context_pages + cfg.headroom_pages
    if L * c <= P:
        return P // L                        # everything resident, growth room included
    depth = Fraction(depth).limit_denominator(1000)   # exact: no r lost to rounding
    for k in sorted({min(depth, L - 1), *range(min(int(depth), L - 1), 0, -1)}, reverse=True):
        r = min(math.floor((P - k * c) / (L - k)), c)
        if r >= 0:
            return r
    return 0 if serves(cfg, 0, context_pages) else -1


def changed_pages(cfg: PolicyConfig, r_old: int, r_new: int) -> range:
    """Physical pages that switch between resident and ring (layout: lp * L + layer)."""
    lo, hi = sorted((max(r_old, 0), r_new))
    return range(cfg.n_layers * lo, cfg.n_layers * hi)


def step(cfg: PolicyConfig, state: PolicyState, obs: Observation) -> Decision:
    depth = _next_depth(cfg, state, obs)
    decode = obs.decode and cfg.decode_depth is not None
    pages = max(obs.context_pages, obs.planned_pages)
    target = target_split(cfg, pages, depth)
    if decode:           # (never fewer resident pages than prefill's split keeps)
        target = max(target, target_split(cfg, pages, cfg.decode_depth))
    cur = state.resident_per_layer
    forced = not serves(cfg, cur, obs.context_pages)
    phase = decode != state.decode and cur >= 0   # prefill <-> decode: no patience

    def keep(reason, pending=None, streak=0):
        s = replace(state, depth=depth, pending=pending, streak=streak)
        return Decision(s, False, cur, ring_slots(cfg, cur), reason)

    if phase and target == cur:
        s = replace(state, depth=depth, pending=None, streak=0, decode=decode)
        return Decision(s, False, cur, ring_slots(cfg, cur), "same split for this phase")
    if not forced and not phase:
        if abs(target - cur) < cfg.hysteresis_pages:
            return keep("within hysteresis")
        streak = state.streak + 1 if state.pending == target else 1
        if streak < cfg.patience:
            return keep(f"waiting ({streak}/{cfg.patience})", target, streak)
    busy = sorted(set(changed_pages(cfg, cur, target)) & set(obs.leased_pages))
    if busy:
        return replace(keep(f"pages {busy[:4]}{'...' if len(busy) > 4 else ''} still "
                            f"leased; drain and ask again", target, state.streak),
                       urgent=forced or phase)
    new = PolicyState(resident_per_layer=target, depth=depth, decode=decode)
    return Decision(new, True, target, ring_slots(cfg, target),
                    "forced: current split cannot serve the context" if forced
                    else f"resident {cur} -> {target} pages per layer"
                    + (f" ({'decode' if decode else 'prefill'})" if phase else ""))


def _next_depth(cfg: PolicyConfig, state: PolicyState, obs: Observation) -> int:
    d = state.depth
    if obs.ring_occupancy is None:
        pass
    elif obs.copy_busy >= cfg.busy_high:
        pass                          # PCIe-bound: only fewer bytes help, and depth 1 stalls
    elif obs.readiness_misses:
        d += 1
    elif obs.ring_occupancy < cfg.occupancy_low:
        d -= 1
    return max(min(cfg.min_depth, cfg.max_depth), 1, min(d, cfg.max_depth))
