"""Placement (one layer's pages for one forward) against a per-page brute-force oracle."""
from __future__ import annotations

import os
import random

import torch

from kvcompile.kv.placement import Placement
from kvcompile.kv.span_plan import Ring

SEED = int.from_bytes(os.urandom(4), "little")


def test_placement_matches_a_per_page_oracle():
    rng = random.Random(SEED)
    for _ in range(300):
        L = rng.randrange(1, 12)
        r = rng.randrange(0, 20)
        n = rng.randrange(1, 60)
        r_eff = min(r, n)
        slots = rng.randrange(max(n - r_eff, 1), 80)
        ring = Ring(L * r, slots)
        cursor = rng.randrange(0, slots)
        pl = Placement.build(rng.randrange(L), L, r_eff, n, ring, cursor)
        oracle = [lp * L + pl.li if lp < r_eff
                  else L * r + (cursor + lp - r_eff) % slots for lp in range(n)]
        msg = (SEED, L, r, n, slots, cursor)
        assert pl.pages() == oracle, msg
        assert [pl.phys(lp) for lp in range(n)] == oracle, msg
        assert len(pl.ring_runs) <= 2, msg
        lo = rng.randrange(0, n)
        hi = rng.randrange(lo, n + 1)
        expand = [(lp0 + k, p0 + k) for lp0, p0, c in pl.runs(lo, hi) for k in range(c)]
        assert expand == [(lp, oracle[lp]) for lp in range(lo, hi)], msg
        table = torch.full((n + 3,), -1, dtype=torch.int32)
        pl.write_table(table, torch.arange(r + 1, dtype=torch.int32) * L + pl.li)
        assert table[:n].tolist() == oracle, msg
        assert pl.span_plan(L * r + slots, ring).page_table(n).tolist() == oracle, msg
