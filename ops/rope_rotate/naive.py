"""fp32 torch reference of rope_rotate (also the CPU implementation)."""
from __future__ import annotations

import torch


def rope_f32(xr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """xr [T, H, R] (fp32): x * cos + partner(x) * sin with cos / signed sin [T, R] as
    layers.rope_rows lays them out; the partner of a dim is its pair (2i, 2i+1), or with
    neox (i, i + R/2)."""
    r = xr.shape[-1]
    if neox:
        partner = torch.cat([xr[..., r // 2:], xr[..., :r // 2]], -1)
    else:
        partner = xr.unflatten(-1, (r // 2, 2)).flip(-1).flatten(-2)
    return xr * cos.float()[:, None, :] + partner * sin.float()[:, None, :]


def rope_rotate_naive(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool,
                      n_rope: int, rot_a: torch.Tensor | None,
                      rot_b: torch.Tensor | None) -> torch.Tensor:
    """x [T, H, D]. Heads < n_rope: rope on the first R dims (rope_f32), then @ rot_a if
    given; the other heads @ rot_b if given. fp32 math, one rounding to x's dtype."""
    xf = x.float()
    a, b = xf[:, :n_rope], xf[:, n_rope:]
    if n_rope:
        r = cos.shape[-1]
        a = torch.cat([rope_f32(a[..., :r], cos, sin, neox), a[..., r:]], -1)
        if rot_a is not None:
            a = a @ rot_a.float()
    if rot_b is not None:
        b = b @ rot_b.float()
    return torch.cat([a, b], 1).to(x.dtype)
