"""Launch options that only untraced launches take (ops/launching.py)."""
from __future__ import annotations

from torch._library.triton import set_wrap_triton_enabled

from kvcompile.ops import launching


def test_register_cap_only_for_untraced_compiled_launches(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with set_wrap_triton_enabled(False):               # inside an op's CUDA implementation
        assert not launching.traced()
        assert launching.register_cap(128) == {"maxnreg": 128}
        assert launching.register_cap(None) == {}
        monkeypatch.setenv("TRITON_INTERPRET", "1")    # the interpreter takes no such option
        assert launching.register_cap(128) == {}
    monkeypatch.delenv("TRITON_INTERPRET")
    assert launching.traced()                          # wrap_triton on: a traced launch
    assert launching.register_cap(128) == {}
