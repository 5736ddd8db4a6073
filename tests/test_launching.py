"""Launch options by launch mode (ops/launching.py)."""
from __future__ import annotations

import torch
from torch._library.triton import set_wrap_triton_enabled

from kvcompile.ops import launching


def test_traced_follows_wrap_triton():
    with set_wrap_triton_enabled(False):               # inside an op's CUDA implementation
        assert not launching.traced()
    assert launching.traced()                          # outside: wrap_triton on


def test_register_cap_unless_compiling_or_interpreting(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert launching.register_cap(128) == {"maxnreg": 128}
    assert launching.register_cap(None) == {}
    with set_wrap_triton_enabled(False):
        assert launching.register_cap(128) == {"maxnreg": 128}
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert launching.register_cap(128) == {}           # inductor takes no such option
    monkeypatch.undo()
    monkeypatch.setenv("TRITON_INTERPRET", "1")        # nor does the interpreter
    assert launching.register_cap(128) == {}
