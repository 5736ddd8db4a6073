"""The Engine and what a request needs around it: configuration, sampling, results, the
speculative drafters, the memory budget and the eval command."""
from kvcompile.engine.engine import Engine, GenerationResult, TokenStream

__all__ = ["Engine", "GenerationResult", "TokenStream"]
