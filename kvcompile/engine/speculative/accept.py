"""Acceptance of a draft against the target's rows of one verify forward.

Row j of the verify forward is the target's next-token distribution after the accepted
history plus draft[:j]. At temperature 0 the accepted tokens are the longest prefix of the
draft equal to the rows' argmax, then the argmax of the first row that disagreed (or of the
row after the whole draft): exactly greedy decoding's tokens. At temperature > 0 with a
deterministic draft (ngram: a point mass; an MTP draft sampled from q is the general case),
draft token d is kept with probability min(1, p(d) / q(d)), and the first rejection samples
from the residual max(0, p - q) renormalized: the emitted tokens follow p exactly (the
standard speculative-sampling argument), so speculation cannot change what is generated,
only how many forwards it takes.
"""
from __future__ import annotations

import torch


def accept_greedy(draft: list[int], argmax_rows: list[int]) -> list[int]:
    """Tokens emitted: draft[:a] + [argmax_rows[a]], a = longest matching prefix
    (argmax_rows has len(draft) + 1 entries)."""
    if len(argmax_rows) != len(draft) + 1:
        raise ValueError(f"{len(draft)} draft tokens need {len(draft) + 1} rows, got "
                         f"{len(argmax_rows)}")
    out = []
    for d, t in zip(draft, argmax_rows):
        if d != t:
            out.append(t)
            return out
        out.append(d)
    out.append(argmax_rows[-1])
    return out


def accept_sampled(draft: list[int], probs_rows, generator: torch.Generator,
                   draft_probs=None) -> list[int]:
    """Tokens emitted for a sampled target: probs_rows[j] is the target's (processed,
    normalized) distribution at row j, len(draft) + 1 rows; draft_probs[j] the drafter's
    distribution q_j it drew draft[j] from (None: a deterministic draft, q = point mass)."""
    if len(probs_rows) != len(draft) + 1:
        raise ValueError(f"{len(draft)} draft tokens need {len(draft) + 1} rows, got "
                         f"{len(probs_rows)}")
    out = []
    for j, d in enumerate(draft):
        p = probs_rows[j]
        q_d = 1.0 if draft_probs is None else float(draft_probs[j][d])
        if torch.rand((), generator=generator).item() * q_d < float(p[d]):
            out.append(d)        # kept with probability min(1, p(d) / q(d))
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - draft_probs[j]).clamp_min(0.0)
        out.append(_draw(residual, generator))
        return out
    out.append(_draw(probs_rows[-1], generator))
    return out


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(weights / weights.sum(), 1, generator=generator)[0])
