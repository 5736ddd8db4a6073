"""draft-mtp: the model's NextN/MTP layer drafts tokens from the trunk's last verified hidden
state, and a drafter that combines it with ngram-simple.

MTP row at position p pairs the trunk's final hidden state at p with the token at p + 1 and
predicts the token at p + 2; its KV (the MTP layer's own attention) sits at position p, in
the same pool as the trunk's and streamed like it. Hidden rows the trunk verified wait in a
backlog until the token after them is known, then go through the MTP layer in one step:
that writes their MTP KV and, for the newest row, gives the first draft token. Deeper
drafts chain the MTP layer on its own output hidden state (positions after the verified
ones; those KV rows are rewritten once the trunk verifies the real hidden states).
Drafting stops at --spec-draft-n-max tokens or when the draft's own probability falls below
--spec-draft-p-min. Drafts are the MTP layer's argmax (a point mass for sampled acceptance).
"""
from __future__ import annotations

import torch

from kvcompile.engine.speculative.decode import Drafter
from kvcompile.engine.speculative.ngram import NgramDrafter

BACKLOG_ROWS = 64      # feed the backlog before it grows past this (rounds drafted by ngram)


class MtpDrafter(Drafter):
    wants_hidden = True

    def __init__(self, mtp_step, n_max: int = 3, p_min: float = 0.7, max_rows: int = 256):
        self.mtp_step = mtp_step            # Executor.mtp: (ids, hidden, start) -> (logits, h)
        self.n_max, self.p_min = n_max, p_min
        self.max_rows = max_rows            # rows a step feeds at most (the prefill ubatch)
        self._rows: list[torch.Tensor] = []  # verified trunk hidden rows not yet fed
        self._start = 0                      # position of the first of them

    @property
    def backlog(self) -> int:
        return sum(r.shape[0] for r in self._rows)

    def reset(self, history) -> None:
        """A new request (its prefill's rows then arrive through `add`)."""
        self._rows, self._start = [], 0

    def add(self, start: int, hidden: torch.Tensor, history) -> None:
        """Trunk hidden rows at positions start.. were computed (a prefill chunk): feed every
        row whose next token is in history (the last prompt row waits for the first
        generated token)."""
        self._append(start, hidden)
        self.flush(history)

    def accepted(self, start: int, emitted: list, hidden) -> None:
        """After a verify step at `start`: its first len(emitted) rows were kept."""
        self._append(start, hidden[:len(emitted)])

    def finish(self, history) -> None:
        """Feed the backlog whose next tokens are known: the MTP layer's rows reach the
        trunk's, so the next request resumes both where the trunk stands."""
        self.flush(history)

    def _append(self, start: int, rows: torch.Tensor) -> None:
        if not self._rows:
            self._start = start
        elif start != self._start + self.backlog:
            raise AssertionError("MTP backlog rows must arrive in position order")
        self._rows.append(rows)

    def flush(self, history):
        """Feed the backlog rows whose next token history holds; (logits, hidden) of that
        MTP step, or None when there was nothing to feed."""
        n = min(self.backlog, len(history) - 1 - self._start)
        if n <= 0:
            return None
        rows = torch.cat(self._rows) if len(self._rows) > 1 else self._rows[0]
        for at in range(0, n, self.max_rows):   # a step's activations stay within a ubatch's
            m = min(self.max_rows, n - at)
            s = self._start + at
            out = self.mtp_step(history[s + 1:s + 1 + m], rows[at:at + m], s)
        self._rows = [rows[n:]] if rows.shape[0] > n else []
        self._start += n
        return out

    def propose(self, history, limit: int) -> list[int]:
        """Up to min(n_max, limit) tokens after history (history[-1] is the pending token;
        the backlog ends at the position before it)."""
        if limit <= 0:
            return []                        # the request's last token: nothing to draft
        out = self.flush(history)
        if out is None:
            return []
        logits, h = out
        pos, draft = len(history) - 1, []
        while True:
            p, token = torch.softmax(logits[-1].float(), dim=-1).max(dim=-1)
            if p.item() < self.p_min:
                break
            draft.append(int(token))
            if len(draft) >= min(self.n_max, limit):
                break
            logits, h = self.mtp_step([draft[-1]], h[-1:], pos - 1 + len(draft))
        return draft


class NgramThenMtp(Drafter):
    """ngram-simple,draft-mtp: the ngram drafter's (wide) draft when the history has a match,
    else the MTP layer's (narrow) one. The MTP backlog keeps every verified row, so the MTP
    KV stays complete whichever drafter proposed."""
    wants_hidden = True

    def __init__(self, ngram: NgramDrafter, mtp: MtpDrafter):
        self.ngram, self.mtp = ngram, mtp

    def reset(self, history) -> None:
        self.ngram.reset(history)
        self.mtp.reset(history)

    def add(self, start, hidden, history) -> None:
        self.mtp.add(start, hidden, history)

    def accepted(self, start, emitted, hidden) -> None:
        self.mtp.accepted(start, emitted, hidden)

    def finish(self, history) -> None:
        self.mtp.finish(history)

    def propose(self, history, limit: int) -> list[int]:
        draft = self.ngram.propose(history, limit)
        if not draft:
            return self.mtp.propose(history, limit)
        if self.mtp.backlog > BACKLOG_ROWS:
            self.mtp.flush(history)
        return draft
