"""Speculative decoding: drafters propose tokens, one verify forward scores them all, an
acceptance rule keeps the longest valid prefix (exactly the target's distribution)."""
from kvcompile.speculative.accept import accept_greedy, accept_sampled  # noqa: F401
from kvcompile.speculative.ngram import NgramDrafter  # noqa: F401
