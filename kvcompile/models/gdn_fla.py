"""Gated DeltaNet on CUDA through the Triton kernels of fla-core (flash-linear-attention).

Same arguments and results as the torch reference in gated_deltanet.py (q, k [T, Hk, Dk];
v [T, Hv, Dv]; g (natural-log decay), beta (post-sigmoid) [T, Hv]; state [Hv, Dk, Dv] fp32;
returns (o [T, Hv, Dv], new state)), so the caller keeps owning the state tensors and
copies the result into them in place. fla wants a batch axis ([B, T, H, D]) and takes
the state as [N, Hv, Dk, Dv] (K before V, as ours).

Key heads: fla's grouped value attention gives value head h the key head h // (Hv / Hk),
while the GGUF orders value heads so that head h reads key head h % Hk (tiling). The keys
are therefore tiled up to Hv heads here, and fla sees Hk == Hv.

Chunked prefill runs fla's chunk kernels with its own chunk size (64): its matmuls on fp32
inputs use TF32 tensor cores, so results differ from the fp32 reference by ~5e-4 relative.
Decode runs the fused recurrent kernel, which is plain fp32 FMA.
"""
from __future__ import annotations

import warnings
from functools import lru_cache

import torch

from kvcompile.ops import debug


@lru_cache(maxsize=None)
def _kernels():
    """(chunk, fused_recurrent) from fla, or None when fla-core is not installed."""
    try:
        from fla.ops.gated_delta_rule import (chunk_gated_delta_rule,
                                              fused_recurrent_gated_delta_rule)
    except ImportError:
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def usable(x: torch.Tensor) -> bool:
    """True when x lives on CUDA, fla-core is importable and not switched off
    (KVCOMPILE_GDN=torch forces the torch reference, to bisect a numerical problem). On CUDA
    without fla-core, warns once that the (much slower) reference runs."""
    if not x.is_cuda or debug.GDN_TORCH:
        return False
    if _kernels() is None:
        _warn_no_fla()
        return False
    return True


@lru_cache(maxsize=None)
def _warn_no_fla() -> None:
    warnings.warn("fla-core is not installed: the Gated DeltaNet layers run the torch "
                  "reference on CUDA, much slower (pip install fla-core)", stacklevel=3)


def _prepare(q, k, v, g, beta, state):
    tiles = v.shape[1] // q.shape[1]          # gated_deltanet checked Hv % Hk == 0
    if tiles > 1:
        q, k = q.repeat(1, tiles, 1), k.repeat(1, tiles, 1)
    return (q[None], k[None], v[None], g[None].float(), beta[None].float(),
            state[None].float())


def chunked(q, k, v, g, beta, state, scale: float):
    """Prefill through fla's chunk_gated_delta_rule."""
    if q.shape[0] == 0:
        return v.new_zeros(v.shape), state.clone()
    chunk, _ = _kernels()
    q, k, v, g, beta, s0 = _prepare(q, k, v, g, beta, state)
    with torch.no_grad():   # fla's autograd wrappers would save activations for nothing
        o, s = chunk(q, k, v, g=g, beta=beta, scale=scale, initial_state=s0,
                     output_final_state=True)
    return o[0], s[0]


def recurrent(q, k, v, g, beta, state, scale: float):
    """Token-by-token (decode) through fla's fused_recurrent_gated_delta_rule. Arguments go
    by keyword: its fifth positional parameter is a per-key decay (gk), not beta."""
    if q.shape[0] == 0:
        return v.new_zeros(v.shape), state.clone()
    _, fused = _kernels()
    q, k, v, g, beta, s0 = _prepare(q, k, v, g, beta, state)
    with torch.no_grad():
        o, s = fused(q, k, v, g=g, beta=beta, scale=scale, initial_state=s0,
                     output_final_state=True)
    return o[0], s[0]
