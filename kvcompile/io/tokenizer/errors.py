"""Tokenizer errors (KvcompileError subclasses, so callers can catch them with the rest)."""
from kvcompile.errors import KvcompileError


class TokenizerError(KvcompileError):
    """A token id outside the vocabulary, or a text the vocabulary cannot encode."""


class ChatTemplateError(KvcompileError):
    """Malformed chat messages, a model without a chat template, or a template that fails."""
