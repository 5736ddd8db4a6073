"""GPT-2 style byte-level BPE: bytes are mapped to printable characters, then merged by rank.

The merge loop follows llama.cpp's: always merge the adjacent pair with the lowest merge
rank, the leftmost one on ties, until no adjacent pair has a rank. Results are cached per
pre-token word (natural text repeats words constantly).
"""
from __future__ import annotations

import heapq

from kvcompile.io.tokenizer.spm import byte_token_text


def _byte_to_char_table() -> list[str]:
    """GPT-2's reversible byte -> character map: printable Latin-1 bytes map to themselves,
    the other 68 bytes to U+0100.. in byte order, so no token text holds a space or control."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = [""] * 256
    for b in printable:
        table[b] = chr(b)
    extra = 0
    for b in range(256):
        if not table[b]:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


BYTE_TO_CHAR = _byte_to_char_table()
CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_CHAR)}


def bytes_to_bpe_text(data: bytes) -> str:
    return "".join(BYTE_TO_CHAR[b] for b in data)


def bpe_text_to_bytes(text: str) -> bytes:
    """Token text -> the bytes it stands for. A character outside the map (malformed vocab)
    contributes its own UTF-8 bytes."""
    out = bytearray()
    for ch in text:
        b = CHAR_TO_BYTE.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


def parse_merges(merges: list[str]) -> dict[tuple[str, str], int]:
    """'left right' strings -> rank. The separator is the first space after the first
    character (a left part may itself be a space in non-byte-level vocabularies)."""
    ranks: dict[tuple[str, str], int] = {}
    for rank, merge in enumerate(merges):
        cut = merge.find(" ", 1)
        if cut < 0:
            continue
        ranks.setdefault((merge[:cut], merge[cut + 1:]), rank)
    return ranks


class BytePairEncoder:
    """byte_level: token texts are GPT-2 byte-to-char strings; otherwise (SentencePiece-style
    BPE, Gemma 4) they are the raw UTF-8 text and a missing byte is the token `<0xNN>`.
    whole_newline_runs: a word of newlines that is a token is emitted without merging."""

    def __init__(self, token_to_id: dict[str, int], ranks: dict[tuple[str, str], int],
                 ignore_merges: bool, byte_level: bool = True, whole_newline_runs: bool = False):
        self.token_to_id = token_to_id
        self.ranks = ranks
        self.ignore_merges = ignore_merges
        self.byte_level = byte_level
        self.whole_newline_runs = whole_newline_runs
        self._cache: dict[str, tuple[int, ...]] = {}

    def encode_word(self, word: str) -> tuple[int, ...]:
        """One pre-token (plain text) -> token ids."""
        hit = self._cache.get(word)
        if hit is not None:
            return hit
        mapped = bytes_to_bpe_text(word.encode("utf-8")) if self.byte_level else word
        whole = self.ignore_merges or (self.whole_newline_runs and not word.strip("\n"))
        if whole and mapped in self.token_to_id:
            ids: tuple[int, ...] = (self.token_to_id[mapped],)
        else:
            ids = tuple(self._symbols_to_ids(self._merge(list(mapped))))
        if len(self._cache) < 200_000:
            self._cache[word] = ids
        return ids

    def _merge(self, symbols: list[str]) -> list[str]:
        if len(symbols) > 48:
            return self._merge_long(symbols)
        ranks = self.ranks
        while len(symbols) > 1:
            best_rank, best_at = None, -1
            for i in range(len(symbols) - 1):
                rank = ranks.get((symbols[i], symbols[i + 1]))
                if rank is not None and (best_rank is None or rank < best_rank):
                    best_rank, best_at = rank, i
            if best_rank is None:
                break
            symbols[best_at:best_at + 2] = [symbols[best_at] + symbols[best_at + 1]]
        return symbols

    def _merge_long(self, symbols: list[str]) -> list[str]:
        """Same merge order in O(n log n) for long words (whitespace runs, base64, minified
        code): a heap of candidate pairs keyed by (rank, left position) over a linked list;
        a popped pair whose two symbols changed since it was queued is skipped."""
        ranks, n = self.ranks, len(symbols)
        sym = symbols[:]
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prev = list(range(-1, n - 1))
        heap: list[tuple[int, int, int, str]] = []

        def push(left: int, right: int) -> None:
            if left >= 0 and right >= 0:
                rank = ranks.get((sym[left], sym[right]))
                if rank is not None:
                    heapq.heappush(heap, (rank, left, right, sym[left] + sym[right]))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if not sym[left] or not sym[right] or sym[left] + sym[right] != merged:
                continue
            sym[left], sym[right] = merged, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])
        return [s for s in sym if s]

    def _symbols_to_ids(self, symbols: list[str]) -> list[int]:
        ids = []
        for sym in symbols:
            tid = self.token_to_id.get(sym)
            if tid is not None:
                ids.append(tid)
                continue
            # llama.cpp's fallback for a merge result missing from the vocab: look up each
            # UTF-8 byte of the symbol as a one-byte token and drop those that do not exist
            for b in sym.encode("utf-8"):
                if self.byte_level:
                    tid = self.token_to_id.get(chr(b)) if b < 0x80 else None
                else:
                    tid = self.token_to_id.get(byte_token_text(b))
                if tid is not None:
                    ids.append(tid)
        return ids
