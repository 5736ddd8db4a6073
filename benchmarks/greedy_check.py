"""Greedy tokens of two runs compared, a divergence forgiven only at a near tie.

Two exact runs over the same context may still round a logit differently (another kernel
computed a row: a reused prefix's last chunk, a streamed page against a resident one), so
their greedy tokens may part where the reference's two best logits are closer than the
rounding. `record_gaps` notes each greedy step's gap between the two largest logits of the
host sampler (the run must step one token at a time: `engine.pipeline = False`, the device
pick never reaches the host sampler); `compare` calls a divergence equal only where the
reference's gap at that step was under `NEAR_TIE`.
"""
from __future__ import annotations

import contextlib

NEAR_TIE = 0.05


@contextlib.contextmanager
def record_gaps(gaps: list):
    """While inside, every greedy pick of an Engine's host sampler appends its top-2 gap."""
    import torch

    import kvcompile.engine.engine as E
    base = E.Sampler

    class Recording(base):
        def __call__(self, logits, history):
            if self.params.temperature == 0:
                top = torch.topk(logits.float().reshape(-1), 2).values
                gaps.append(float(top[0] - top[1]))
            return super().__call__(logits, history)

    E.Sampler = Recording
    try:
        yield gaps
    finally:
        E.Sampler = base


def compare(tokens: list[int], reference: list[int], ref_gaps: list[float]) -> dict:
    """Whether `tokens` equal `reference`, or part from it only at a near tie."""
    i = next((k for k, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
    if i is None and len(tokens) != len(reference):
        i = min(len(tokens), len(reference))
    gap = ref_gaps[i] if i is not None and i < len(ref_gaps) else None
    return dict(tokens_equal=i is None, first_difference=i, gap_at_difference=gap,
                equal_or_near_tie=i is None or (gap is not None and gap < NEAR_TIE))
