"""Value checks of the index tensors the KV ops take: q_pos, slots and page_table.

Shapes and dtypes are checked on every call (each op's check_*_args). Values are another
matter: on CUDA, reading them is a device-to-host synchronization, which a captured step
cannot make, a traced one cannot see, and an eager step (one call a layer) should not pay.
So they are checked where they already are on the host (CPU tensors: always) and on CUDA
only in eager calls with KVCOMPILE_CHECK_INDICES=1 (read at import; `ENABLED` may be set by
tests). The engine needs neither: the caches check positions on the host once a forward
(kv_cache.check_positions) and page tables come from span plans, which refuse gaps and
overlaps (kvcompile.kv.span_plan). These checks are for direct callers of the ops, where a bad
page id would otherwise read or write outside the pools.
"""
from __future__ import annotations


import torch

from kvcompile.errors import KvLayoutError
from kvcompile.ops import debug

ENABLED = debug.CHECK_INDICES


def values_readable(*tensors: torch.Tensor | None) -> bool:
    """Whether these tensors' values are checked now: real (not fake, not traced) tensors on
    the CPU, or on CUDA with ENABLED outside stream capture."""
    ts = [t for t in tensors if t is not None]
    devices = {t.device.type for t in ts}
    if devices == {"cuda"}:                  # the decode steps' path: off unless asked
        if not ENABLED or torch.cuda.is_current_stream_capturing():
            return False
    elif devices != {"cpu"}:
        return False
    return not torch.compiler.is_compiling() and all(type(t) is torch.Tensor for t in ts)


def _bounds(x: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty integer tensor, one host read."""
    if x.numel() <= 16:                      # decode rows: cheaper as a list
        values = x.tolist()
        return min(values), max(values)
    lo, hi = torch.aminmax(x)
    return int(lo), int(hi)


def _check_pages(pages: torch.Tensor, n_pages: int, what: str) -> None:
    lo, hi = _bounds(pages)
    if lo < 0 or hi >= n_pages:
        raise KvLayoutError(f"{what} name physical pages {lo}..{hi}; the pools have pages "
                            f"0..{n_pages - 1}")


def _check_in_table(lo: int, hi: int, page_table: torch.Tensor, page_size: int,
                    what: str) -> None:
    """Positions lo..hi lie in the table's logical pages (`what` names them, with its verb)."""
    cap = page_table.numel() * page_size
    if lo < 0 or hi >= cap:
        raise KvLayoutError(
            f"{what} {lo}..{hi}, but the page_table's {page_table.numel()} logical "
            f"pages of {page_size} positions cover 0..{cap - 1}: pass a page_table of at "
            f"least {hi // page_size + 1} entries and positions >= 0")


def check_context_table(page_table: torch.Tensor, q_pos: torch.Tensor, n_pages: int,
                        page_size: int, window: int = 0) -> None:
    """span_attention: every q_pos in [0, len(page_table) * page_size), and the logical
    pages read (from the first one some row's window reaches, 0 without a window, up to the
    last) each naming a distinct physical page of the pools (a span plan without gaps or
    overlaps)."""
    if q_pos.numel() == 0:
        return
    lo, hi = _bounds(q_pos)
    _check_in_table(lo, hi, page_table, page_size, "q_pos spans")
    first = max(lo - window + 1, 0) // page_size if window > 0 else 0
    check_distinct_pages(page_table[first: hi // page_size + 1], n_pages,
                         "page_table entries")


def check_piece_pages(piece_table: torch.Tensor, first_page: int, q_pos: torch.Tensor,
                      n_pages: int, page_size: int) -> None:
    """A staged prefill piece (logical pages first_page.. of a layer): the entries of the
    pages some query row reads lie in the pools, none twice (pages past every row are not
    read and not checked)."""
    if q_pos.numel() == 0:
        return
    read = _bounds(q_pos)[1] // page_size + 1 - first_page
    check_distinct_pages(piece_table[: max(read, 0)], n_pages, "piece_table entries")


def check_distinct_pages(pages: torch.Tensor, n_pages: int, what: str) -> None:
    """Each entry of `pages` a physical page of the pools, none twice (a span plan, or a
    staged piece of one, without overlaps)."""
    if pages.numel() == 0:
        return
    _check_pages(pages, n_pages, f"{what} 0..{pages.numel() - 1}")
    if torch.unique(pages).numel() == pages.numel():
        return
    seen, first = torch.sort(pages.long(), stable=True)
    i = int((seen[1:] == seen[:-1]).nonzero()[0, 0])
    raise KvLayoutError(
        f"{what} {int(first[i])} and {int(first[i + 1])} both name physical page "
        f"{int(seen[i])}: a span plan must not overlap (kvcompile.kv.span_plan)")


def check_write_targets(slots: torch.Tensor, page_table: torch.Tensor | None, n_pages: int,
                        page_size: int) -> None:
    """kv_write: slots in [0, n_pages * page_size); with a page_table, positions in
    [0, len(page_table) * page_size) whose pages lie in the pools."""
    if slots.numel() == 0:
        return
    lo, hi = _bounds(slots)
    if page_table is None:
        cap = n_pages * page_size
        if lo < 0 or hi >= cap:
            raise KvLayoutError(f"slots span {lo}..{hi}; {n_pages} pages of {page_size} "
                                f"positions hold slots 0..{cap - 1}")
        return
    _check_in_table(lo, hi, page_table, page_size, "positions span")
    _check_pages(page_table[slots.long() // page_size], n_pages,
                 "the page_table entries of these positions")
