"""Where a request's tokens come from after prefill: one token a forward (pipelined on
the device when the sampler can draw there), or verify steps of the pending token and a
draft. Both yield tokens one at a time; the Engine's loop appends
each token it keeps to `history` (a stop ends it), and each forward's time, to the sampler's
read of its result (GPU completion), goes to `step_s`."""
from __future__ import annotations

import time
from abc import ABC, abstractmethod

import torch

from kvcompile.speculative.accept import accept_greedy, accept_sampled


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


def plain_tokens(forward, logits, sampler, history, budget, step_s):
    """One token a forward: sampled from the logits, fed back at the next position."""
    for step in range(budget):
        if step:
            t = time.perf_counter()
            logits = forward([history[-1]], len(history) - 1)
        token = sampler(logits, history)
        if step:
            step_s.append(time.perf_counter() - t)
        yield token


def pipelined_tokens(forward, logits, pick, history, budget, step_s):
    """Tokens, one a forward, with each forward queued before the host reads the token
    before it: `pick` (Sampler.pick) draws the token where the logits are and the next
    forward takes it there, so the host's work for a step (the policy, the graph launch)
    overlaps the step before it on the device. A stop found in a token leaves the forward
    after it computed for nothing (its row lies past the history; the next forward at that
    position rewrites it). A step's time runs from the read of the token before it to the
    read of its own: the tokens' wall clock, GPU completion included."""
    if budget <= 0:
        return
    cuda = logits.device.type == "cuda"
    host = torch.empty(1, dtype=torch.long, pin_memory=cuda)
    read = torch.cuda.Event() if cuda else None
    token_at = pick(logits)
    start = len(history)                 # the first token's position
    last = None
    for k in range(budget):
        host.copy_(token_at, non_blocking=True)
        if read is not None:
            read.record()
        if k + 1 < budget:                # the next forward, before this token is read
            token_at = pick(forward(token_at, start + k))
        if read is not None:
            read.synchronize()
        token, now = int(host[0]), time.perf_counter()
        if last is not None:
            step_s.append(now - last)
        last = now
        yield token


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
