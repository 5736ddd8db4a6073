"""Where a request's tokens come from after prefill without speculation: one token a
forward, pipelined on the device when the sampler can draw there. Both sources yield tokens
one at a time; the Engine's loop appends each token it keeps to `history` (a stop ends it),
and each forward's time, to the sampler's read of its result (GPU completion), goes to
`step_s`. Speculative rounds: engine/speculative/decode.py."""
from __future__ import annotations

import time

import torch


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
    host = torch.empty(1, dtype=torch.long, device="cpu", pin_memory=cuda)
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
