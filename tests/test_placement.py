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


def test_windowed_placement_reads_from_its_first_page_only():
    """A windowed layer's placement (`first`: its window's first page): the pages it reads
    are resident below r, in consecutive ring slots from max(r, first) on; table entries
    between r and first are left alone (never read), and it takes no slot for them."""
    rng = random.Random(SEED + 1)
    for _ in range(300):
        L, r, n = rng.randrange(1, 12), rng.randrange(0, 20), rng.randrange(1, 60)
        r_eff, first = min(r, n), rng.randrange(0, n)
        start = max(r_eff, first)
        slots = rng.randrange(max(n - start, 1), 80)
        ring = Ring(L * r, slots)
        cursor = rng.randrange(0, slots)
        pl = Placement.build(rng.randrange(L), L, r_eff, n, ring, cursor, first)
        oracle = {lp: lp * L + pl.li if lp < r_eff else L * r + (cursor + lp - start) % slots
                  for lp in range(first, n)}
        msg = (SEED, L, r, n, first, slots, cursor)
        assert list(pl.read_pages()) == list(range(first, n)), msg
        assert pl.pages() == [oracle[lp] for lp in pl.read_pages()], msg
        assert pl.n_streamed == n - start and pl.n_resident_read == max(r_eff - first, 0), msg
        lo = rng.randrange(first, n)
        hi = rng.randrange(lo, n + 1)
        expand = [(lp0 + k, p0 + k) for lp0, p0, c in pl.runs(lo, hi) for k in range(c)]
        assert expand == [(lp, oracle[lp]) for lp in range(lo, hi)], msg
        table = torch.full((n + 3,), -1, dtype=torch.int32)
        pl.write_table(table, torch.arange(r + 1, dtype=torch.int32) * L + pl.li)
        assert table[first:n].tolist() == [oracle[lp] for lp in range(first, n)], msg
        assert table[r_eff:start].tolist() == [-1] * (start - r_eff), msg
        plan = pl.span_plan(L * r + slots, ring)
        assert plan.page_table(n)[first:].tolist() == [oracle[lp] for lp in range(first, n)]
