"""The searches behind the quantizer (quantize.py): a (sub-)block's float scale (and min)
for its codes, least squares refitting the scale (and min) to the codes a candidate set,
the best candidate per row winning; the sums are fixed halving trees (`tsum`) so the bytes
are the same on every device."""
from __future__ import annotations

import torch


def tsum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of 2) by halving: a fixed order on every device."""
    while t.shape[-1] > 1:
        h = t.shape[-1] // 2
        t = t[..., :h] + t[..., h:]
    return t


def nonzero(t: torch.Tensor) -> torch.Tensor:
    """A divisor: zeros replaced by 1 (their quotients are masked or multiplied by 0)."""
    return torch.where(t == 0, torch.ones_like(t), t)


def signed_absmax(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The value of largest magnitude along dim, with its sign (the max on a tie)."""
    hi, lo = t.amax(dim, keepdim=True), t.amin(dim, keepdim=True)
    return torch.where(hi >= -lo, hi, lo)


class Levels:
    """The values a code can stand for: integers lo..hi, or a sorted codebook."""

    def __init__(self, lo: int, hi: int, table: tuple[int, ...] | None = None):
        self.lo, self.hi, self.table = lo, hi, table

    def nearest(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(code index from 0, level value as fp32) nearest to each y."""
        if self.table is None:
            v = torch.round(y).clamp(self.lo, self.hi)
            return (v - self.lo).to(torch.uint8), v
        t = torch.tensor(self.table, dtype=torch.float32, device=y.device)
        idx = torch.bucketize(y, (t[1:] + t[:-1]) / 2)
        return idx.to(torch.uint8), t[idx]


# candidates are tried side by side along a new leading dim, as many at a time as keep that
# under this many values: a few hundred kernel launches a call instead of thousands (the
# writer's threads share one GIL), memory bounded; the bytes do not depend on it
SEARCH_ELEMENTS = 1 << 25


def better(best, cand):
    """Per row, whichever tuple has the smaller first entry (an error); ties keep `best`."""
    if best is None:
        return cand
    keep = cand[0] < best[0]
    return tuple(torch.where(keep, c, b) for c, b in zip(cand, best))


def search_best(x: torch.Tensor, cands, evaluate, best=None):
    """Per row, the candidate of least error (the first on ties). cands: numbers or tuples
    of numbers; evaluate(*columns) gets each as a tensor [G, 1, ..., 1] (x.dim() ones) and
    returns (error, values...) with G leading; returns the winner's (error, values...)."""
    cols = torch.tensor(cands, dtype=torch.float32, device=x.device).reshape(len(cands), -1)
    group = max(1, SEARCH_ELEMENTS // max(1, x.numel()))
    for at in range(0, len(cands), group):
        c = cols[at:at + group]
        out = evaluate(*(c[:, j].reshape(-1, *[1] * x.dim()) for j in range(c.shape[1])))
        i = out[0].argmin(0, keepdim=True)
        best = better(best, tuple(torch.take_along_dim(t, i, 0).squeeze(0) for t in out))
    return best


def _ls_scale(x, v):
    """Least-squares s for x ~ s v per row of the last dim, and its score sum(xv)^2 / sum(vv)
    (the squared error is sum(xx) minus the score)."""
    sxv, svv = tsum(torch.stack((x * v, v * v)))
    s = torch.where(svv > 0, sxv / nonzero(svv), torch.zeros_like(sxv))
    return s, s * sxv


def fit_scale(x: torch.Tensor, lv: Levels, factors, rounds: int = 2) -> torch.Tensor:
    """Signed scale s [..., 1] for x [..., B] ~ s * level. A candidate factor f > 0 maps
    the value of largest magnitude, mx, to f times the lowest level (the longer side of the
    asymmetric ranges), f < 0 to |f| times the highest; a round re-codes under the best s."""
    mx = nonzero(signed_absmax(x, -1))

    def evaluate(f):
        s, score = _ls_scale(x, lv.nearest(x * (torch.where(f > 0, lv.lo * f, -lv.hi * f) / mx))[1])
        return -score, s
    best = search_best(x, factors, evaluate)
    for _ in range(rounds):
        s, score = _ls_scale(x, lv.nearest(x / nonzero(best[1]))[1])
        best = better(best, (-score, s))
    return best[1]


def _ls_affine(x, q, sx, sxx, nonneg_min: bool):
    """Least-squares (s, b) for x ~ s q + b per row, and the squared error left (sx, sxx:
    the rows' sum and sum of squares); with nonneg_min, b <= 0 (the K-quants store the min
    as -dmin * m with m >= 0)."""
    n = x.shape[-1]
    sq, sqq, sqx = tsum(torch.stack(torch.broadcast_tensors(q, q * q, q * x)))
    det = n * sqq - sq * sq                     # exact: small integers
    ok = det > 0
    s = torch.where(ok, (n * sqx - sq * sx) / nonzero(det), torch.zeros_like(sqx))
    b = torch.where(ok, (sqq * sx - sq * sqx) / nonzero(det), sx / n)
    if nonneg_min:
        fix = b > 0
        s = torch.where(fix, sqx / nonzero(sqq), s)
        b = torch.where(fix, torch.zeros_like(b), b)
    # at the least-squares optimum the residual is orthogonal to q and 1: error in closed form
    return sxx - s * sqx - b * sx, s, b


def fit_affine(x: torch.Tensor, nmax: int, factors, nonneg_min: bool, rounds: int = 2):
    """(s, b) [..., 1] for x [..., B] ~ s q + b with codes q in 0..nmax. Candidates
    shrink the [min, max] range about its middle by `factors`."""
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    if nonneg_min:
        lo = lo.clamp(max=0)
    width = hi - lo
    sx, sxx = tsum(torch.stack((x, x * x)))

    def evaluate(f):
        q = torch.round((x - (lo + width * ((1 - f) / 2))) * (nmax / nonzero(width * f)))
        return _ls_affine(x, q.clamp_(0, nmax), sx, sxx, nonneg_min)
    best = search_best(x, factors, evaluate)
    for _ in range(rounds):      # re-code under the best fit so far, refit
        q = torch.round((x - best[2]) / nonzero(best[1])).clamp_(0, nmax)
        best = better(best, _ls_affine(x, q, sx, sxx, nonneg_min))
    # codes rise with x, so the fitted s >= 0 up to rounding
    return best[1].clamp(min=0), best[2]
