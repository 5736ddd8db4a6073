"""Speculative decoding's token source: verify steps of the pending token and a draft, and
what a drafter offers it. Like the plain sources (engine/tokens.py) it yields tokens one at a
time; the Engine's loop appends each token it keeps to `history` (a stop ends it), and each
round's time goes to `step_s`."""
from __future__ import annotations

import time
from abc import ABC, abstractmethod

from kvcompile.engine.speculative.accept import accept_greedy, accept_sampled


class Drafter(ABC):
    """What speculative_tokens asks of a drafter: `propose` (every drafter has its own);
    the hooks a drafter needs no state for do nothing here."""
    wants_hidden = False        # True: verify steps return the rows' hidden states

    def reset(self, history) -> None:
        """A new request whose prompt is history (before its prefill)."""

    def add(self, start: int, hidden, history) -> None:
        """A prefill chunk at start computed these hidden rows (wants_hidden only)."""

    @abstractmethod
    def propose(self, history, limit: int) -> list[int]:
        """Up to `limit` tokens to follow history (history[-1]: the pending token)."""

    def accepted(self, start: int, emitted: list[int], hidden) -> None:
        """The verify step at start kept len(emitted) rows (hidden: its rows, or None)."""

    def finish(self, history) -> None:
        """The request ends with `history`: bring what the drafter keeps in the store up
        to date with it (the next request may resume there)."""


def speculative_tokens(verify, rollback, drafter, logits, sampler, history, budget, ctx_size,
                       step_s, stats):
    """Tokens from verify steps: the pending token and the drafter's proposal go through
    one step (every row's logits, and the rows' hidden states when the drafter wants them);
    the acceptance rule keeps the draft's valid prefix and adds the target's own token after
    it. `rollback(keep, rows, start)` undoes the rejected rows (recurrent state, host history);
    their KV rows on the device are rewritten by the next step (attention is causal by
    position: never read before).
    A round's time (drafting, verify, acceptance) goes to step_s."""
    if budget <= 0:
        return
    made = 1
    yield sampler(logits, history)
    while made < budget:
        t = time.perf_counter()
        pos = len(history) - 1           # the pending token's position
        room = min(budget - made - 1, ctx_size - 1 - pos)
        draft = drafter.propose(history, room)
        rows, hidden = verify([history[-1]] + draft, pos, hidden=drafter.wants_hidden)
        emitted = accept(draft, rows, sampler, history)
        rollback(len(emitted), len(draft) + 1, pos)
        drafter.accepted(pos, emitted, hidden)
        step_s.append(time.perf_counter() - t)
        stats.record(len(draft), len(emitted) - 1, step_s[-1])
        for tok in emitted:
            made += 1
            yield tok


def accept(draft, rows, sampler, history) -> list[int]:
    """The tokens a verify forward emits: the sampler's own rule per row (its penalty sees
    the draft prefix as history), greedy or sampled acceptance over the rows."""
    hist = list(history)
    if sampler.params.temperature == 0:
        picks = []
        for j, row in enumerate(rows):
            picks.append(sampler(row, hist + draft[:j]))
            if j < len(draft) and picks[-1] != draft[j]:
                break
        picks += [0] * (len(draft) + 1 - len(picks))     # rows past a mismatch: unused
        return accept_greedy(draft, picks)
    probs = [sampler.probs(row, hist + draft[:j]) for j, row in enumerate(rows)]
    return accept_sampled(draft, probs, sampler.generator)
