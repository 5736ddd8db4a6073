"""llama SentencePiece (SPM, BPE-with-scores) tokenization as llama.cpp runs it.

Text is split into characters; the adjacent pair whose concatenation is a vocabulary piece
with the highest score is merged first (leftmost on ties), repeatedly. A final symbol that
is not a piece is written as byte-fallback tokens `<0xNN>`.
"""
from __future__ import annotations

import heapq

from kvcompile.errors import UnsupportedModelError

SPACE_MARK = "\u2581"  # '▁', SentencePiece's visible space


def byte_token_text(b: int) -> str:
    return f"<0x{b:02X}>"


class SentencePieceEncoder:
    def __init__(self, token_to_id: dict[str, int], scores: list[float]):
        self.token_to_id = token_to_id
        self.scores = scores
        self._byte_ids: list[int | None] = []
        for b in range(256):
            tid = token_to_id.get(byte_token_text(b))
            if tid is None and b < 0x80:
                tid = token_to_id.get(chr(b))  # llama.cpp falls back to the byte as text
            self._byte_ids.append(tid)

    def encode(self, text: str) -> list[int]:
        """`text` already has spaces replaced by '▁' (and the optional prefix added)."""
        chars = list(text)
        n = len(chars)
        if n == 0:
            return []
        # doubly linked list over symbols; a merged-away symbol gets length 0
        sym = chars[:]                 # current text of each symbol
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap: list[tuple[float, int, int, int]] = []
        token_to_id, scores = self.token_to_id, self.scores

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            merged = sym[left] + sym[right]
            tid = token_to_id.get(merged)
            if tid is None or tid >= len(scores):
                return
            heapq.heappush(heap, (-scores[tid], left, right, len(merged)))

        for i in range(1, n):
            push(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != size:
                continue  # stale: one side was merged since this pair was queued
            sym[left] += sym[right]
            sym[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])

        out: list[int] = []
        i = 0
        while i != -1:
            piece = sym[i]
            tid = token_to_id.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                for b in piece.encode("utf-8"):
                    byte_id = self._byte_ids[b]
                    if byte_id is None:
                        raise UnsupportedModelError(
                            f"the SPM vocabulary has no byte-fallback token {byte_token_text(b)} "
                            f"for text {piece!r}; this GGUF's vocabulary cannot encode it")
                    out.append(byte_id)
            i = nxt[i]
        return out
