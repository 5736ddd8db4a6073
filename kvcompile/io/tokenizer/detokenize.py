"""Detokenizer post-processing and streaming decode."""
from __future__ import annotations

import codecs


def clean_up_spaces(data: bytes) -> bytes:
    """llama.cpp's `clean_spaces` passes for BPE vocabularies that ask for them (the Hugging
    Face `clean_up_tokenization_spaces` rule): drop the space in " ?", " !", " .", " ,";
    turn " ' " into "'"; drop the space before 's, 'm, 're and 've. Each pass compacts the
    buffer in place and looks back at the *input* byte before the current one, exactly as
    llama.cpp's loops do (their edge cases, e.g. " ' ' ", come out the same)."""
    buf = bytearray(data)
    n = _compact(buf, len(buf), _drop_space_before_punct)
    n = _compact(buf, n, _join_lone_apostrophe)
    n = _compact(buf, n, _drop_space_before_contraction)
    return bytes(buf[:n])


def _compact(buf: bytearray, n: int, rule) -> int:
    """Run `rule(buf, i, n)` for i = 1..n-1; it returns (drop_previous_output, skip_next)."""
    total = 1 if n else 0
    i = 1
    while i < n:
        x = buf[i]
        drop_prev, skip_next = rule(buf, i, n)
        if drop_prev:
            total -= 1
        if skip_next:
            i += 1
            buf[i] = 0  # the skipped byte can no longer count as a space for the next look-back
        buf[total] = x
        total += 1
        i += 1
    return total


def _drop_space_before_punct(buf, i, n):
    return buf[i - 1] == 0x20 and buf[i] in b"?!.,", False


def _join_lone_apostrophe(buf, i, n):
    hit = buf[i] == 0x27 and i + 1 < n and buf[i - 1] == 0x20 and buf[i + 1] == 0x20
    return hit, hit


def _drop_space_before_contraction(buf, i, n):
    if buf[i - 1] != 0x20 or buf[i] != 0x27 or i + 1 >= n:
        return False, False
    x1 = buf[i + 1]
    if x1 in b"sm":
        return True, False
    if x1 in b"td" or i + 2 >= n:
        return False, False
    return (x1, buf[i + 2]) in ((0x72, 0x65), (0x76, 0x65)), False  # 're, 've


class StreamDecoder:
    """Turns generated token ids into text pieces as they arrive. Bytes of a character split
    across tokens are held back until the character is complete; `flush()` returns what is
    left at the end (an incomplete character becomes U+FFFD)."""

    def __init__(self, tokenizer, skip_special: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        data = self._tokenizer.token_bytes(token_id, special=not self._skip_special)
        return self._utf8.decode(data)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
