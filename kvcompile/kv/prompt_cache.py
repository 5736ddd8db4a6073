"""The prompt cache: besides the history the store holds, the histories of recent
conversations (kv/snapshot.py) in host memory up to a byte budget, least recently used out.

Before a request resumes (kv/prefix.py), `swap_in` compares its prompt with the live history
and with every cached one. A cached history that gives a longer reusable prefix replaces the
live one, which is cached in its place; a live history the prompt would mostly cut away (a
new conversation) is cached before the cut. So two conversations taking turns each resume
their own history.
"""
from __future__ import annotations

from kvcompile.kv.prefix import common_prefix
from kvcompile.kv.snapshot import History, held_nbytes, put, take


class PromptCache:
    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self.entries: list[History] = []          # least recently used first

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.entries)

    def add(self, h: History) -> bool:
        """Keep h (evicting the least recently used to fit); False if it cannot fit."""
        if h.nbytes > self.budget or not h.held():
            return False
        while self.entries and self.nbytes + h.nbytes > self.budget:
            self.entries.pop(0)
        self.entries.append(h)
        return True

    def best(self, prompt: list[int]) -> tuple[int, History | None]:
        """The cached history sharing the longest prefix with prompt, and that length."""
        scored = [(common_prefix(h.held(), prompt), h) for h in self.entries]
        return max(scored, key=lambda x: x[0], default=(0, None))


def keep_live(store, cache: PromptCache) -> None:
    """A copy of the store's history in the cache (a history over the budget: no copy)."""
    if held_nbytes(store) <= cache.budget:
        cache.add(take(store))


def set_aside(store, cache: PromptCache, ubatch: int, trunk=None) -> None:
    """Before a request that starts cold over the store (cache_prompt=False): the live
    history, when it holds a ubatch or more, goes to the cache as a new conversation's
    would (swap_in)."""
    if cache.budget and len(store.prefix.held(trunk)) >= ubatch:
        keep_live(store, cache)


def swap_in(store, cache: PromptCache, prompt: list[int], ubatch: int, trunk=None) -> None:
    """Make the store hold the history this prompt reuses most of (module doc)."""
    if not cache.budget:
        return
    def reuse(n: int) -> int:                     # what a resume keeps (prefix.py)
        return min(n, len(prompt) - 1) // ubatch * ubatch

    held = store.prefix.held(trunk)
    live = reuse(common_prefix(held, prompt))
    n, h = cache.best(prompt)
    if h is not None and reuse(n) > live:
        cache.entries.remove(h)
        if held:
            keep_live(store, cache)
        put(store, h)
    elif len(held) >= ubatch and live < len(held) // 2:
        keep_live(store, cache)                    # a new conversation: keep the old one
