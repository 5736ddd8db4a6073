"""Collapse text to one stand-in character per character class, so the pre-tokenizer regexes
only need tiny character classes (the same trick llama.cpp uses for its std::regex path).

ASCII stays as it is (the regexes name ASCII characters: contractions, `\\r`, `\\n`, space);
every other character becomes a private-use stand-in for its class: whitespace, letter (L),
number (N), mark (M), punctuation (P) or anything else. Classes come from the Unicode 15.1
tables llama.cpp uses. One character maps to one character, so match offsets in the
collapsed text are offsets in the original.
"""
from __future__ import annotations

import bisect

import regex

from kvcompile.io.tokenizer import unicode_tables

# llama.cpp's whitespace set (the Unicode White_Space property)
NON_ASCII_WHITESPACE = frozenset(
    [0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000])

REP_WHITESPACE, REP_LETTER, REP_NUMBER, REP_MARK, REP_PUNCT, REP_OTHER = (
    "\ue000", "\ue001", "\ue002", "\ue003", "\ue004", "\ue005")

# regex character-class bodies over collapsed text
WS = "\\t\\n\\x0b\\x0c\\r " + REP_WHITESPACE
L = "A-Za-z" + REP_LETTER
N = "0-9" + REP_NUMBER
M = REP_MARK
P = regex.escape("!\"#%&'()*,-./:;?@[\\]_{}") + REP_PUNCT  # ASCII punctuation is category P


def _parse_ranges(body: str) -> list[tuple[int, int]]:
    out = []
    for m in regex.finditer(r"\\[uU]([0-9a-fA-F]+)(?:-\\[uU]([0-9a-fA-F]+))?", body):
        lo = int(m.group(1), 16)
        out.append((lo, int(m.group(2), 16) if m.group(2) else lo))
    return out


def _range_table() -> tuple[list[int], list[int], list[str]]:
    rows = []
    for body, rep in ((unicode_tables.LETTER, REP_LETTER), (unicode_tables.NUMBER, REP_NUMBER),
                      (unicode_tables.MARK, REP_MARK), (unicode_tables.PUNCTUATION, REP_PUNCT)):
        rows += [(lo, hi, rep) for lo, hi in _parse_ranges(body)]
    rows.sort()
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


_STARTS, _ENDS, _REPS = _range_table()


def stand_in(cp: int) -> str:
    """The collapsed character for code point `cp`."""
    if cp < 0x80:
        return chr(cp)
    if cp in NON_ASCII_WHITESPACE:
        return REP_WHITESPACE
    i = bisect.bisect_right(_STARTS, cp) - 1
    if i >= 0 and cp <= _ENDS[i]:
        return _REPS[i]
    return REP_OTHER


class _StandInTable(dict):
    """str.translate table filled on first sight of each code point."""

    def __missing__(self, cp: int) -> str:
        rep = stand_in(cp)
        if len(self) < 100_000:  # bounded: adversarial text could name every code point
            self[cp] = rep
        return rep


_TABLE = _StandInTable()


def collapse(text: str) -> str:
    return text.translate(_TABLE)
