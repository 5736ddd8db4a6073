"""Prefill attention over a layer's KV that arrives in staged pieces.

When a streamed layer's KV does not fit in the ring, it is staged a piece at a time (a run
of consecutive logical pages). Each piece is consumed by ALL query tiles in one launch, so
it can be released and the next one staged: the KV crosses host-to-device once however
many query rows the batch has. Between launches every (query head, query row) carries its
online-softmax state (running max m, sum l, fp32 accumulator) in an fp32 workspace; the
launch of the last piece normalizes and writes the output.

Pieces come in logical order from page 0 (a windowed layer's: from the first page some
row's window reaches, `first_page`; earlier pages are never read) and end at the layer's
last page. Any split then
gives bitwise the output of span_attention_prefill in one launch over the same pages: the
same key tiles in the same order through the same kernel code (prefill_kernel.py).

Without Triton (a CPU tensor, not interpreting) there is nothing to release: each piece's
page bytes are copied aside and the op's fp32 reference runs once at the last piece, so
the result equals torch.ops.kvcompile.span_attention on the CPU bitwise.
"""
from __future__ import annotations

import torch

from kvcompile.errors import KvLayoutError
from kvcompile.ops import kv_format as F
from kvcompile.ops.launching import interpreting
from kvcompile.ops.span_attention.launch import dot_mode, query_operand
from kvcompile.ops.span_attention.naive import span_attention_naive, window_first_page
from kvcompile.ops.index_checks import check_piece_pages, values_readable
from kvcompile.ops.span_attention.op import check_span_attention_args
from kvcompile.ops.span_attention.prefill_kernel import (  # noqa: F401  (its public home)
    launch_prefill, workspace_numel)


class PrefillAccumulator:
    """Causal attention of q [T, Hq, D] (rows at q_pos) over n_pages logical KV pages that
    are consumed piece by piece: `consume(k_pool, v_pool, piece_table)` per piece, in
    logical order; the call that consumes the last page returns the output.

    piece_table: int32 [n], physical page of logical pages first..first + n - 1 (first =
    the pages consumed so far). workspace: fp32, contiguous, at least workspace_numel(T,
    Hq, D) elements, untouched by others until the last piece (allocated when None).
    out: [T, Hq, D] with a dense last dim (q's dtype when None). Launcher options
    (block_m, block_n, num_warps, num_stages) go to every launch; keep them fixed.
    window > 0: a sliding window (span_attention's); the first piece starts at
    `first_page` (read from q_pos once, on the host)."""

    def __init__(self, q, q_pos, k_type: int, v_type: int, page_size: int, scale: float,
                 n_pages: int, *, out=None, workspace=None, use_kernel: bool | None = None,
                 window: int = 0, **launch_opts):
        if q.dim() != 3:
            raise KvLayoutError(f"q must be [T, n_q_heads, head_dim], got {tuple(q.shape)}")
        if not isinstance(n_pages, int) or n_pages < 1:
            raise KvLayoutError(f"n_pages must be a positive int (the layer's logical pages), "
                                f"got {n_pages!r}")
        n_rows, n_q, d = q.shape
        F.check_cuda_head_dim(q.device, d, "prefill kernel")
        if out is None:
            out = torch.empty_like(q)
        if out.shape != q.shape or out.stride(2) != 1 or out.device != q.device:
            raise KvLayoutError(f"out must be [T, Hq, D] = {tuple(q.shape)} on {q.device} "
                                f"with a dense last dim, got {tuple(out.shape)} on "
                                f"{out.device}")
        self.kernel = (q.device.type == "cuda" or interpreting()) if use_kernel is None \
            else use_kernel
        if workspace is not None:
            need = workspace_numel(n_rows, n_q, d)
            if (workspace.dtype != torch.float32 or not workspace.is_contiguous()
                    or workspace.numel() < need or workspace.device != q.device):
                raise KvLayoutError(f"workspace must be a contiguous float32 tensor of at "
                                    f"least {need} elements on {q.device}, got "
                                    f"{workspace.dtype} x {workspace.numel()} on "
                                    f"{workspace.device}")
        self.q, self.q_pos, self.out, self.workspace = q, q_pos, out, workspace
        self.k_type, self.v_type = k_type, v_type
        self.page_size, self.scale, self.n_pages = page_size, scale, n_pages
        self.launch_opts = launch_opts
        self.window = window
        self.first_page = window_first_page(q_pos, window, page_size)
        self.next_page = self.first_page
        self._q16 = None          # the query operand, converted once for all launches
        self._pieces = []         # reference path: (K pages, V pages) copied aside

    @property
    def done(self) -> bool:
        return self.next_page == self.n_pages

    def consume(self, k_pool, v_pool, piece_table, first_page: int | None = None):
        """Attend every query row over one staged piece; returns `out` after the last
        piece, else None. After it returns (in stream order) the piece may be released."""
        first = self.next_page if first_page is None else first_page
        if self.done:
            raise KvLayoutError(f"all {self.n_pages} pages were consumed; start a new "
                                f"PrefillAccumulator for another prefill")
        if first != self.next_page:
            raise KvLayoutError(f"pieces must come in logical order without gaps: expected "
                                f"a piece from logical page {self.next_page}, got {first}")
        check_span_attention_args(self.q, k_pool, v_pool, piece_table, self.q_pos,
                                  self.k_type, self.v_type, self.page_size)
        n = piece_table.shape[0]
        if n < 1 or first + n > self.n_pages:
            raise KvLayoutError(f"a piece of {n} pages from logical page {first} does not "
                                f"fit the layer's {self.n_pages} pages; give 1.."
                                f"{self.n_pages - first} pages")
        if values_readable(piece_table, self.q_pos):
            check_piece_pages(piece_table, first, self.q_pos, k_pool.shape[0], self.page_size)
        last = first + n == self.n_pages
        if self.kernel:
            self._launch(k_pool, v_pool, piece_table, first, last)
        else:
            self._pieces.append((k_pool.index_select(0, piece_table.long()),
                                 v_pool.index_select(0, piece_table.long())))
            if last:
                self._reference()
        self.next_page = first + n
        return self.out if last else None

    def _launch(self, k_pool, v_pool, piece_table, first, last):
        q = self.q
        if self._q16 is None:
            self._q16 = query_operand(q, dot_mode(q.dtype, F.kv_type(self.k_type).ggml_id))
        if self.workspace is None and not last:
            self.workspace = torch.empty(workspace_numel(*q.shape), dtype=torch.float32,
                                         device=q.device)
        launch_prefill(self._q16, k_pool, v_pool, piece_table, self.q_pos, self.k_type,
                       self.v_type, self.page_size, self.scale, self.out,
                       n_pages=self.n_pages, first_page=first, workspace=self.workspace,
                       load_state=first > self.first_page, finish=last, window=self.window,
                       **self.launch_opts)

    def _reference(self):
        if int(self.q_pos.max()) >= self.n_pages * self.page_size:
            raise KvLayoutError(f"a query row at position {int(self.q_pos.max())} is past "
                                f"the {self.n_pages} pages of {self.page_size} consumed")
        kp = torch.cat([k for k, _ in self._pieces])
        vp = torch.cat([v for _, v in self._pieces])
        self._pieces = []
        # logical page i is piece page i - first_page (earlier entries are never read)
        table = (torch.arange(self.n_pages, dtype=torch.int32, device=kp.device)
                 - self.first_page).clamp_(min=0)
        self.out.copy_(span_attention_naive(self.q, kp, vp, table, self.q_pos, self.k_type,
                                            self.v_type, self.page_size, self.scale,
                                            self.window))
