"""Pre-tokenizer: split text into the words that BPE merges within, per `tokenizer.ggml.pre`.

llama.cpp applies a list of regexes in turn: each one splits every piece produced so far
into its matches *and* the gaps between them (nothing is dropped), and a later regex only
sees one piece at a time, so its look-arounds and `$` stop at the piece's edges.

The regexes run over the collapsed text of `collapse.py` (one stand-in character per class),
so every character class is small and exact: whitespace is llama.cpp's set (the Unicode
White_Space property; `\\s` differs between engines, e.g. for U+001C..U+001F), and letters /
numbers / marks / punctuation are the Unicode 15.1 categories that llama.cpp's tables hold
(`\\p{L}` in `regex` follows a newer Unicode, where e.g. Egyptian Hieroglyphs Extended-A
are letters). Pieces are cut from the original text at the same offsets.
"""
from __future__ import annotations

from dataclasses import dataclass

import regex

from kvcompile.errors import UnsupportedModelError
from kvcompile.io.tokenizer.collapse import L as _L
from kvcompile.io.tokenizer.collapse import M as _M
from kvcompile.io.tokenizer.collapse import N as _N
from kvcompile.io.tokenizer.collapse import P as _P
from kvcompile.io.tokenizer.collapse import WS as _WS
from kvcompile.io.tokenizer.collapse import collapse
_S = f"[{_WS}]"          # one whitespace character
_NOT_S = f"[^{_WS}]"     # one non-whitespace character

# GPT-2's split: contractions, optional-space letter/number/other runs, whitespace runs
# (a run followed by non-space gives up its last character to the next word).
_GPT2 = (rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{_L}]+| ?[{_N}]+| ?[^{_WS}{_L}{_N}]+"
         rf"|{_S}+(?!{_NOT_S})|{_S}+")

_CONTRACTIONS_ANY_CASE = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"


def _llama3_style(number: str, letter: str, not_word: str) -> str:
    """Llama-3 / Qwen family: a word may carry one leading non-letter, numbers in short
    groups, punctuation runs swallow trailing newlines, newline runs keep leading spaces."""
    return (rf"{_CONTRACTIONS_ANY_CASE}|[^\r\n{_L}{_N}]?{letter}+|{number}"
            rf"| ?[^{_WS}{not_word}]+[\r\n]*|{_S}*[\r\n]+|{_S}+(?!{_NOT_S})|{_S}+")


_LLAMA3 = _llama3_style(f"[{_N}]{{1,3}}", f"[{_L}]", _L + _N)
_QWEN2 = _llama3_style(f"[{_N}]", f"[{_L}]", _L + _N)
_QWEN35 = _llama3_style(f"[{_N}]", f"[{_L}{_M}]", _L + _M + _N)


@dataclass(frozen=True)
class PreTokenizerSpec:
    name: str
    patterns: tuple[str, ...]
    ignore_merges: bool = False   # a word that is itself a token is emitted without merging
    default_add_bos: bool = False
    clean_spaces: bool = True     # detokenizer removes spaces before . , ! ? and some 's
    # SentencePiece-style BPE (llama.cpp's escape_whitespaces, byte_encode = false): spaces
    # become '▁' before the split, token texts are raw UTF-8, missing bytes are <0xNN>
    spm_style: bool = False
    whole_newline_runs: bool = False  # a word of newlines that is a token is not merged
    force_add_bos: bool = False       # BOS even where the GGUF says add_bos_token = false


_DEFAULT = PreTokenizerSpec("default", (rf"[{_P}\$\+<=>\^~\|]+", _GPT2, f"[{_N}]+", "[0-9]{3}"))
_GPT2_SPEC = PreTokenizerSpec("gpt2", (_GPT2,))
_SMOLLM = PreTokenizerSpec("smollm", (f"[{_N}]", _GPT2), clean_spaces=False)
_STARCODER = PreTokenizerSpec("starcoder", (f"[{_N}]", _GPT2))
_LLAMA3_SPEC = PreTokenizerSpec("llama3", (_LLAMA3,), ignore_merges=True, default_add_bos=True)
_DBRX = PreTokenizerSpec("dbrx", (_LLAMA3,))
_QWEN2_SPEC = PreTokenizerSpec("qwen2", (_QWEN2,), clean_spaces=False)
_STABLELM2 = PreTokenizerSpec("stablelm2", (_QWEN2,))
_QWEN35_SPEC = PreTokenizerSpec("qwen35", (_QWEN35,), clean_spaces=False)
# Gemma 4: merges run over whole lines (newline runs apart), as llama.cpp's GEMMA4 type
_GEMMA4 = PreTokenizerSpec("gemma4", ("[^\\n]+|[\\n]+",), default_add_bos=True, spm_style=True,
                           whole_newline_runs=True, force_add_bos=True)


def _names(spec: PreTokenizerSpec, *names: str) -> dict[str, PreTokenizerSpec]:
    return {name: spec for name in names}


# `tokenizer.ggml.pre` value -> spec (names and flags as llama.cpp's vocab loader maps them)
PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "default": _DEFAULT,
    **_names(_GPT2_SPEC, "gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "gigachat"),
    **_names(_SMOLLM, "smollm", "command-r"),
    **_names(_STARCODER, "starcoder", "refact", "codeshell", "exaone", "minerva-7b"),
    **_names(_LLAMA3_SPEC, "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
             "midm-2.0", "lfm2"),
    **_names(_DBRX, "dbrx", "smaug-bpe"),
    **_names(_QWEN2_SPEC, "qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan",
             "solar-open", "grok-2"),
    **_names(_STABLELM2, "stablelm2", "megrez"),
    "qwen35": _QWEN35_SPEC,
    **_names(_GEMMA4, "gemma4", "granite-embed-multi-311m"),
}


def pre_tokenizer_spec(pre: str | None) -> PreTokenizerSpec:
    if not pre:
        return _DEFAULT  # llama.cpp also falls back to 'default' when the key is missing
    try:
        return PRE_TOKENIZERS[pre]
    except KeyError:
        known = ", ".join(sorted(PRE_TOKENIZERS))
        raise UnsupportedModelError(
            f"tokenizer.ggml.pre = {pre!r} is not a supported pre-tokenizer; supported: "
            f"{known}. Use a model whose GGUF names one of these") from None


class PreTokenizer:
    def __init__(self, spec: PreTokenizerSpec):
        self.spec = spec
        self._compiled = [regex.compile(p) for p in spec.patterns]

    def split(self, text: str) -> list[str]:
        collapsed = collapse(text)
        spans = [(0, len(text))] if text else []
        for pattern in self._compiled:
            spans = [part for span in spans for part in _split_keep_gaps(pattern, collapsed, span)]
        return [text[a:b] for a, b in spans]


def _split_keep_gaps(pattern: regex.Pattern, text: str, span: tuple[int, int]):
    """Matches of `pattern` inside text[span] and the gaps between them, as spans. The
    pattern sees text[span] as the whole string (look-arounds stop at its edges)."""
    start, stop = span
    out: list[tuple[int, int]] = []
    end = start
    for m in pattern.finditer(text[start:stop]):
        a, b = m.start() + start, m.end() + start
        if a == b:
            continue
        if a > end:
            out.append((end, a))
        out.append((a, b))
        end = b
    if end < stop:
        out.append((end, stop))
    return out
