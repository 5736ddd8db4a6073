"""Token types and the split of text around special-token strings (before any BPE/SPM).

As in llama.cpp, special tokens are searched longest text first; every occurrence of one
in the not-yet-split text becomes that token, the text around it stays raw for the next
(shorter) special token. CONTROL and UNKNOWN tokens are only recognised when
`parse_special` is set; USER_DEFINED tokens always are.
"""
from __future__ import annotations

from enum import IntEnum


class TokenType(IntEnum):
    """`tokenizer.ggml.token_type` values."""
    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Texts llama.cpp always treats as control tokens (end of turn / generation, fill-in-middle),
# whatever type the converter wrote for them.
END_OF_TURN_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "<end_of_utterance>", "<|return|>", "<|call|>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "</s>", "<eos>", "<turn|>", "<|tool_response>",
    "[EOS]", "<|flush|>", "<|calls|>",
})
_FIM_TEXTS = frozenset({
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "\u2581<PRE>",
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "\u2581<SUF>",
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "\u2581<MID>",
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
})
FORCED_CONTROL_TEXTS = END_OF_TURN_TEXTS | _FIM_TEXTS


# Where one of these also ends a sequence, '</s>' is an ordinary token (Gemma 4, PLaMo)
_PLAIN_S_MARKERS = ("<|tool_response>", "<|plamo:eos|>")


def effective_types(tokens: list[str], types: list[int], eos_id: int | None = None) -> list[int]:
    """The token types llama.cpp works with: the forced control texts are CONTROL, except
    '</s>', which is NORMAL next to an end-of-sequence '<|tool_response>' / '<|plamo:eos|>'."""
    out = [int(TokenType.CONTROL) if text in FORCED_CONTROL_TEXTS else t
           for text, t in zip(tokens, types)]
    ends = set(END_OF_TURN_TEXTS) | ({tokens[eos_id]} if eos_id is not None else set())
    if any(m in ends and m in tokens for m in _PLAIN_S_MARKERS):
        out = [int(TokenType.NORMAL) if text == "</s>" else t for text, t in zip(tokens, out)]
    return out


class SpecialTokenSplitter:
    def __init__(self, tokens: list[str], types: list[int]):
        special = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)
        found = [(i, text) for i, (text, t) in enumerate(zip(tokens, types))
                 if t in special and text]
        found.sort(key=lambda it: -len(it[1].encode("utf-8")))  # stable: ties keep id order
        self._always = [(i, text) for i, text in found if types[i] == TokenType.USER_DEFINED]
        self._all = found

    def split(self, text: str, parse_special: bool) -> list[str | int]:
        """-> raw text pieces (str) and special token ids (int), in order."""
        parts: list[str | int] = [text] if text else []
        for tid, special in (self._all if parse_special else self._always):
            if not any(isinstance(p, str) and special in p for p in parts):
                continue
            new_parts: list[str | int] = []
            for p in parts:
                if not isinstance(p, str) or special not in p:
                    new_parts.append(p)
                    continue
                chunks = p.split(special)
                for k, chunk in enumerate(chunks):
                    if k:
                        new_parts.append(tid)
                    if chunk:
                        new_parts.append(chunk)
            parts = new_parts
        return parts
