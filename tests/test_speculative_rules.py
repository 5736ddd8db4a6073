"""Speculative decoding's pure parts: the ngram drafter against a brute-force search, greedy
acceptance, and sampled acceptance preserving the target distribution exactly (a chi-square
test over a bigram "model"), with a deliberately wrong rule failing the same test."""
from __future__ import annotations

import math
import os
import random

import pytest
import torch

from kvcompile.errors import KvcompileError
from kvcompile.engine.speculative import NgramDrafter, accept_greedy, accept_sampled

SEED = int.from_bytes(os.urandom(4), "little")


def brute_draft(h, n, m):
    if len(h) < n:
        return []
    key = h[-n:]
    for i in range(len(h) - 1, n - 1, -1):     # latest earlier occurrence ending before the end
        if i < len(h) and h[i - n:i] == key and i != len(h):
            return h[i:i + m]
    return []


def test_ngram_drafts_what_a_search_finds():
    rng = random.Random(SEED)
    for _ in range(200):
        n, m = rng.randrange(1, 4), rng.randrange(1, 6)
        d = NgramDrafter(n, m)
        hist = [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        d.reset(hist[:len(hist) // 2])
        d.extend(hist[len(hist) // 2:])
        assert d.draft() == brute_draft(hist, n, m), (SEED, n, m, hist)
        cut = rng.randrange(0, len(hist) + 1)
        d.truncate(cut)
        assert d.history == hist[:cut] and d.draft() == brute_draft(hist[:cut], n, m), SEED
        assert d.draft(limit=1) == brute_draft(hist[:cut], n, 1), SEED
    with pytest.raises(KvcompileError, match="spec-ngram-size-n"):
        NgramDrafter(0, 4)


def test_greedy_acceptance_is_the_longest_matching_prefix():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept_greedy([5], [4, 1]) == [4]
    assert accept_greedy([], [3]) == [3]
    with pytest.raises(ValueError):
        accept_greedy([1, 2], [1, 2])


def _critical(df: int, z: float = 2.3263) -> float:
    """The chi-square value with p = 0.01 above it (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _speculate_two(table, start, draft, gen, rule):
    """Two tokens from `start` with a two-token deterministic draft: the verify rows are the
    bigram table's rows after start, draft[0] (what a verify forward computes)."""
    rows = [table[start], table[draft[0]], table[draft[1]]]
    out = rule(draft, rows, gen)
    if len(out) < 2:                     # rejected at the first: decode the second plainly
        nxt = table[out[0]]
        out.append(int(torch.multinomial(nxt, 1, generator=gen)[0]))
    return out[:2]


def _wrong_rule(draft, rows, gen):
    """Keeps the draft with probability p(d) but resamples from p itself on a rejection."""
    out = []
    for j, d in enumerate(draft):
        if torch.rand((), generator=gen).item() < float(rows[j][d]):
            out.append(d)
            continue
        out.append(int(torch.multinomial(rows[j], 1, generator=gen)[0]))
        return out
    out.append(int(torch.multinomial(rows[-1], 1, generator=gen)[0]))
    return out


@pytest.mark.parametrize("rule", ["exact", "wrong"])
def test_sampled_acceptance_preserves_the_target_distribution(rule):
    """Joint distribution of the first two emitted tokens against the bigram model's own
    T[s, a] * T[a, b] over 6 x 6 cells, 24,000 samples: the exact rule passes the
    chi-square test at p = 0.01, the wrong rule fails it."""
    V, N = 6, 24000
    gen = torch.Generator().manual_seed(SEED % 2**31)
    table = torch.softmax(2.0 * torch.randn(V, V, generator=gen), -1)
    start, draft = 0, [int(table[0].argmax()), int(table[int(table[0].argmax())].argmin())]
    fn = (lambda d, r, g: accept_sampled(d, r, g)) if rule == "exact" else _wrong_rule
    expected = N * table[start][:, None] * table
    keep = expected > 5
    df = int(keep.sum()) - 1
    passes = []
    # two independent samples: a right rule fails one at p = 0.01 by chance (1%), both
    # only 0.01% of the time; the wrong rule must fail both
    for _ in range(2):
        counts = torch.zeros(V, V)
        for _ in range(N):
            a, b = _speculate_two(table, start, draft, gen, fn)
            counts[a, b] += 1
        chi2 = float(((counts - expected) ** 2 / expected)[keep].sum())
        print(f"{rule}: chi2 {chi2:.1f}, critical {_critical(df):.1f} (df {df}), seed {SEED}")
        passes.append(chi2 < _critical(df))
    assert any(passes) == (rule == "exact"), (SEED, passes, df)


def test_sampled_acceptance_with_a_sampled_draft_keeps_p():
    """A drafter that samples its token from q: min(1, p/q) and the residual max(0, p - q)
    give back p for the first token (chi-square over 20,000 samples)."""
    V, N = 5, 20000
    gen = torch.Generator().manual_seed((SEED + 1) % 2**31)
    p = torch.softmax(torch.randn(V, generator=gen), -1)
    q = torch.softmax(torch.randn(V, generator=gen), -1)
    chis = []
    for _ in range(2):                   # two samples, as above
        counts = torch.zeros(V)
        for _ in range(N):
            d = int(torch.multinomial(q, 1, generator=gen)[0])
            counts[accept_sampled([d], [p, p], gen, draft_probs=[q])[0]] += 1
        chis.append(float(((counts - N * p) ** 2 / (N * p)).sum()))
    assert min(chis) < _critical(V - 1), (SEED, chis)
