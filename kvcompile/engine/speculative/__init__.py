"""Speculative decoding: drafters propose tokens, one verify forward scores them all, an
acceptance rule keeps the longest valid prefix (exactly the target's distribution)."""
from kvcompile.engine.speculative.accept import accept_greedy, accept_sampled  # noqa: F401
from kvcompile.engine.speculative.ngram import NgramDrafter  # noqa: F401
