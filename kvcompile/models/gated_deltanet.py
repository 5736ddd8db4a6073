"""Gated DeltaNet compute in plain torch: the reference for the CPU and for kernels.

One GDN head keeps a state matrix S [Dk, Dv]. Per token, with log-decay g <= 0 and write
strength beta in (0, 1):

    S <- exp(g) S
    S <- S + k (beta (v - S^T k))^T        (delta rule: replace what k used to recall)
    o  = scale * S^T q

`gdn_recurrent` runs that loop token by token (decode); `gdn_chunked` computes the same
thing chunk by chunk (prefill): inside a chunk the corrections form a unit lower-triangular
system (I + A) Delta = beta (V - exp(G) K S0) that is solved once, and the state only moves
at chunk borders. Both take the same arguments and return (o, new state).

Shapes: q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; state [Hv, Dk, Dv]. When Hv > Hk,
value head h reads key head h % Hk: llama.cpp's qwen35 graph tiles q/k across value heads
(ggml_repeat), so the GGUF stores value heads in that order.

`causal_conv` is the short depthwise convolution in front of GDN, with its rolling state.

On CUDA, when fla-core is installed, both rules run its Triton kernels (gdn_fla); the
torch code below is the CPU path and the reference those kernels are tested against.
"""
from __future__ import annotations

import torch

from kvcompile.models import gdn_fla


def expand_key_heads(x: torch.Tensor, n_v_heads: int) -> torch.Tensor:
    """[T, Hk, D] -> [T, Hv, D], value head h taking key head h % Hk (tiling)."""
    n_k_heads = x.shape[1]
    if n_v_heads % n_k_heads:
        raise ValueError(f"{n_v_heads} value heads cannot share {n_k_heads} key heads")
    return x.repeat(1, n_v_heads // n_k_heads, 1)


def gdn_recurrent(q, k, v, g, beta, state, scale: float):
    """Token-by-token delta rule. Returns (o [T, Hv, Dv], state [Hv, Dk, Dv]). Under
    torch.compile it is one opaque op (`kvcompile::gdn_recurrent`): dynamo does not trace
    into fla-core's kernels or this loop; eagerly it is a plain call."""
    if torch.compiler.is_compiling():
        return torch.ops.kvcompile.gdn_recurrent(q, k, v, g, beta, state, scale)
    return _recurrent(q, k, v, g, beta, state, scale)


@torch.library.custom_op("kvcompile::gdn_recurrent", mutates_args=())
def _recurrent_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, state: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _recurrent(q, k, v, g, beta, state, scale)


@_recurrent_op.register_fake
def _(q, k, v, g, beta, state, scale):
    return v.new_empty(v.shape), state.new_empty(state.shape)


def _recurrent(q, k, v, g, beta, state, scale: float):
    n_v_heads = v.shape[1]
    q, k = expand_key_heads(q, n_v_heads), expand_key_heads(k, n_v_heads)
    if gdn_fla.usable(q):
        return gdn_fla.recurrent(q, k, v, g, beta, state, scale)
    s = state.clone()
    out = []
    for t in range(q.shape[0]):
        s = s * torch.exp(g[t])[:, None, None]
        recalled = torch.einsum("hkv,hk->hv", s, k[t])
        delta = (v[t] - recalled) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[t]) * scale)
    return torch.stack(out) if out else v.new_zeros(v.shape), s


def gdn_chunked(q, k, v, g, beta, state, scale: float, chunk: int = 64):
    """Chunkwise-parallel delta rule, equal to gdn_recurrent up to rounding. (fla, on
    CUDA, uses its own chunk size.)"""
    n_v_heads = v.shape[1]
    q, k = expand_key_heads(q, n_v_heads), expand_key_heads(k, n_v_heads)
    if gdn_fla.usable(q):
        return gdn_fla.chunked(q, k, v, g, beta, state, scale)
    # heads first: [H, T, D], [H, T]
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    g, beta = g.transpose(0, 1), beta.transpose(0, 1)
    s = state.clone()
    outs = []
    for c0 in range(0, q.shape[1], chunk):
        sl = slice(c0, c0 + chunk)
        o, s = _one_chunk(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], s, scale)
        outs.append(o)
    if not outs:
        return v.new_zeros(v.transpose(0, 1).shape), s
    return torch.cat(outs, dim=1).transpose(0, 1), s


def _one_chunk(q, k, v, g, beta, s0, scale):
    n = q.shape[1]
    cum = torch.cumsum(g, dim=1)                                  # G_i, [H, n]
    diff = cum[:, :, None] - cum[:, None, :]                      # G_i - G_j
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    # mask before exp: the upper triangle holds positive differences that could overflow
    decay = torch.exp(diff.masked_fill(~causal, float("-inf")))   # exp(G_i - G_j), j <= i
    strict = decay.masked_fill(torch.eye(n, dtype=torch.bool, device=q.device), 0.0)
    a = beta[:, :, None] * strict * (k @ k.transpose(1, 2))       # A_ij, j < i
    eye = torch.eye(n, dtype=q.dtype, device=q.device).expand_as(a)
    lhs = eye + a
    gate_now = torch.exp(cum)[:, :, None]                          # exp(G_i)
    rhs = torch.cat([beta[:, :, None] * v, beta[:, :, None] * gate_now * k], dim=2)
    sol = torch.linalg.solve_triangular(lhs, rhs, upper=False, unitriangular=True)
    u, w = sol[..., : v.shape[2]], sol[..., v.shape[2]:]
    delta = u - w @ s0                                             # [H, n, Dv]
    o = (gate_now * q) @ s0 + (decay * (q @ k.transpose(1, 2))) @ delta
    to_end = torch.exp(cum[:, -1:] - cum)[:, :, None]              # exp(G_n - G_j)
    s_end = torch.exp(cum[:, -1])[:, None, None] * s0 + (to_end * k).transpose(1, 2) @ delta
    return o * scale, s_end


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor):
    """Depthwise causal conv over time. x [T, C]; conv_state [K-1, C] holds the previous
    K-1 inputs, oldest first; weight [C, K], column K-1 multiplies the current input.
    Returns (y [T, C], new conv_state [K-1, C])."""
    width = weight.shape[1]
    padded = torch.cat([conv_state.to(x.dtype), x], dim=0)         # [K-1+T, C]
    windows = padded.unfold(0, width, 1)                           # [T, C, K]
    y = (windows * weight.to(x.dtype)).sum(-1)
    return y, padded[padded.shape[0] - (width - 1):]
