"""ngram-simple: the last n tokens of the history looked up in the history itself (prompt and
generated tokens); the up to m tokens that followed their latest earlier occurrence are the
draft. An index from n-gram to the position after its latest occurrence is kept as tokens
arrive, so a lookup is one dict read whatever the history's length."""
from __future__ import annotations

from kvcompile.errors import KvcompileError
from kvcompile.engine.speculative.decode import Drafter


class NgramDrafter(Drafter):
    def __init__(self, n: int = 3, m: int = 8):
        for name, v, lo in (("--spec-ngram-size-n", n, 1), ("--spec-ngram-size-m", m, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise KvcompileError(f"{name} must be an integer >= {lo}, got {v!r}")
        self.n, self.m = n, m
        self.history: list[int] = []
        self._after: dict[tuple, int] = {}   # n-gram -> index after its latest occurrence

    def reset(self, tokens=()) -> None:
        self.history, self._after = [], {}
        self.extend(tokens)

    def extend(self, tokens) -> None:
        for t in tokens:
            self.append(t)

    def append(self, token: int) -> None:
        h, n = self.history, self.n
        if len(h) >= n:     # the n-gram ending here becomes an earlier occurrence
            self._after[tuple(h[-n:])] = len(h)
        h.append(int(token))

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens (rejected drafts leave the history); the index is
        rebuilt only when an entry pointed past the cut."""
        if length >= len(self.history):
            return
        kept = self.history[:length]
        if any(i > length - 1 for i in self._after.values()):
            self.reset(kept)
        else:
            self.history = kept

    def draft(self, limit: int | None = None) -> list[int]:
        """Up to min(m, limit) tokens continuing the history, or [] without a match."""
        h, n = self.history, self.n
        if len(h) < n:
            return []
        at = self._after.get(tuple(h[-n:]))
        if at is None:
            return []
        k = self.m if limit is None else min(self.m, limit)
        return h[at:at + k]

    def propose(self, history, limit: int) -> list[int]:
        """(the accepted tokens arrive here, with the history)"""
        self.extend(history[len(self.history):])
        return self.draft(limit=limit) if limit > 0 else []
