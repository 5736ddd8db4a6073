"""How the streaming cache's arena is cut into KV pages: bytes of a layer's page, how many
pages fit an arena, the smallest arena that serves a context, and the per-layer extras a
streamed layer shares with PagedKvCache."""
from __future__ import annotations

from kvcompile.kv_cache import PagedKvCache
from kvcompile.ops import kv_format as F
from kvcompile.runtime.arena import align


def min_arena_bytes(config, max_tokens: int, k_type="f32", v_type="f32", page_size=256,
                    workspace_bytes: int = 0) -> int:
    """Smallest arena that serves max_tokens: the ring must hold one layer's whole context."""
    kb, vb = page_bytes(config, k_type, v_type, page_size)
    pages = -(-max_tokens // page_size)
    return align(workspace_bytes) + align(pages * kb) + align(pages * vb)


def layer_extras(config, k_type, v_type, page_size, layer) -> dict:
    """Whatever else PagedKvCache hands the model per layer (e.g. the rotations quantized
    KV is stored with), taken from a one-page PagedKvCache so both caches store the same
    bytes and stay interchangeable."""
    proto = PagedKvCache(config, 1, k_type, v_type, page_size, layers=(layer,)).layer(layer)
    return {n: getattr(proto, n) for n in ("k_rot", "v_rot") if getattr(proto, n, None) is not None}


def page_bytes(config, k_type, v_type, page_size) -> tuple[int, int]:
    h, d = config.n_kv_heads, config.head_dim
    return (F.page_bytes(F.kv_type(k_type), page_size, h, d),
            F.page_bytes(F.kv_type(v_type), page_size, h, d))


def fit_pages(nbytes: int, kb: int, vb: int) -> int:
    n = nbytes // (kb + vb)
    while n > 0 and align(n * kb) + align(n * vb) > nbytes:
        n -= 1
    return n
