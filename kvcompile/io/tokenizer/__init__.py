"""Tokenizer from GGUF metadata: byte-level BPE, llama SentencePiece and Gemma 4's
SentencePiece-style BPE, chat templates, streaming decode. Token ids equal llama.cpp's for
the supported vocabularies."""
from __future__ import annotations

import os

from kvcompile.io.tokenizer.chat import render_chat_template, validate_messages
from kvcompile.io.tokenizer.detokenize import StreamDecoder
from kvcompile.io.tokenizer.errors import ChatTemplateError, TokenizerError
from kvcompile.io.tokenizer.special import TokenType
from kvcompile.io.tokenizer.tokenizer import Tokenizer


def load_tokenizer(gguf_path: str | os.PathLike) -> Tokenizer:
    """Build the tokenizer of a GGUF model file (reads its metadata only)."""
    from kvcompile.io.gguf.reader import GgufFile

    return Tokenizer.from_metadata(GgufFile(gguf_path).metadata)


__all__ = [
    "Tokenizer", "StreamDecoder", "TokenType", "load_tokenizer", "render_chat_template",
    "validate_messages", "ChatTemplateError", "TokenizerError",
]
