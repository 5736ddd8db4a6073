import random

import pytest

from kvcompile.engine.stop_strings import StopStringFilter


def run(pieces, stops):
    f = StopStringFilter(stops)
    return "".join(f.feed(p) for p in pieces) + f.flush(), f.stopped


@pytest.mark.parametrize("seed", range(20))
def test_random_splits_equal_whole_text_truncation(seed):
    rng = random.Random(seed)
    alphabet = "ab\nEND"
    text = "".join(rng.choice(alphabet) for _ in range(60))
    stops = ("END", "\n\n", "bab")
    cuts = sorted(rng.sample(range(1, len(text)), 10))
    pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
    hits = [text.find(s) for s in stops if s in text]
    expected = text[: min(hits)] if hits else text
    out, stopped = run(pieces, stops)
    assert out == expected and stopped == bool(hits)


def test_holds_back_only_possible_prefixes():
    f = StopStringFilter(("STOP",))
    assert f.feed("abcST") == "abc"
    assert f.feed("x") == "STx"
    assert f.feed("STO") == ""
    assert f.feed("P more") == "" and f.stopped
