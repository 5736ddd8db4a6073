"""kvcompile: long-context LLM inference with exact attention over a streamed KV cache."""
from kvcompile.errors import KvcompileError  # noqa: F401

__version__ = "0.1.0"
