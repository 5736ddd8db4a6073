"""benchmarks/bench_sweep.py on the CPU (--tiny): the rows of a streamed arena, `auto` and
(when transformers is installed) the HF peer, the time guard, and the plot (when matplotlib
is installed)."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

_path = Path(__file__).parents[1] / "benchmarks" / "bench_sweep.py"
_spec = importlib.util.spec_from_file_location("bench_sweep", _path)
B = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(B)

PEERS = importlib.util.find_spec("transformers") is not None
FIELDS = ("system", "arena_mib", "arena_mib_used", "ctx", "kv_type", "prefill_tok_s",
          "decode_tok_s", "step_p50_ms", "bound_kind", "bound_tok_s", "decode_vs_bound",
          "commit", "date", "device")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "sweep.json"
    # 0.3 MiB of KV arena: the 512-token context (0.42 MiB of q8_0/q4_0 KV) streams
    argv = ["--tiny", "--device", "cpu", "--contexts", "256,512", "--arenas", "0.3,auto",
            "--decode-steps", "4", "--out", str(out)]
    return B.main(argv + ([] if PEERS else ["--no-peers"])), out


def test_rows_have_the_fields_and_finite_rates(sweep):
    rows, out = sweep
    assert json.loads(out.read_text())["rows"] == rows            # appended as they ended
    ours = [(r["arena_mib"], r["ctx"]) for r in rows if r["system"] == "kvcompile"]
    assert ours == [(0.3, 256), (0.3, 512), ("auto", 256), ("auto", 512)]
    if PEERS:      # on the CPU only the resident peer (transformers' offloading needs CUDA)
        assert [(r["system"], r["ctx"]) for r in rows[4:]] == [("hf-resident", 256),
                                                               ("hf-resident", 512)]
        assert all(r["kv_type"] == "f32/f32" for r in rows[4:])    # the weights' dtype
    for r in rows:
        assert all(k in r for k in FIELDS), r
        for k in ("prefill_tok_s", "decode_tok_s"):
            assert math.isfinite(r[k]) and r[k] > 0, (k, r)
    for r in rows[:4]:
        assert r["kv_type"] == "q8_0/q4_0" and r["step_p50_ms"] > 0 and r["captures"] in (0, None)
        assert r["cached_tokens"] == 0                 # every context's prefill is whole
    by = {(r["arena_mib"], r["ctx"]): r for r in rows[:4]}
    streamed = by[(0.3, 512)]
    assert streamed["bound_kind"] == "pcie" and streamed["bound_tok_s"] > 0
    assert streamed["decode_vs_bound"] > 0 and streamed["kv"]["streamed_fraction"] > 0
    assert by[(0.3, 256)]["bound_kind"] is None          # the whole KV fits the arena
    assert by[("auto", 512)]["arena_mib_used"] == 0      # the Engine's auto on the CPU: resident
    for ctx in (256, 512):       # the same prompt streamed or resident: the same tokens
        assert by[(0.3, ctx)]["tokens"] == by[("auto", ctx)]["tokens"]


def test_plot_and_plot_only(sweep, tmp_path):
    pytest.importorskip("matplotlib")
    rows, out = sweep
    B.plot_rows(rows, str(tmp_path / "a.png"))
    B.main(["--plot-only", str(out), "--plot", str(tmp_path / "b.png")])
    for name in ("a.png", "b.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_latest_rows_take_the_newest_commit_and_row():
    def row(commit, ctx, rate):
        return dict(kind="sweep", system="kvcompile", arena_mib=1024, ctx=ctx,
                    kv_type="q8_0/q4_0", commit=commit, decode_tok_s=rate)
    rows = [row("a", 8192, 1), row("b", 8192, 2), dict(kind="runner"), row("b", 8192, 3),
            row("b", 32768, 4)]
    assert [r["decode_tok_s"] for r in B.latest_rows(rows)] == [3, 4]


def test_guard_skips_what_would_end_past_the_limit():
    g = B.Guard(200)
    assert g.admit("first", "kvcompile", 8192)            # nothing measured: no estimate
    g.record("kvcompile", 8192, 10)
    assert g.admit("32K", "kvcompile", 32768)             # 10 s x 4^2 = 160 s
    assert not g.admit("64K", "kvcompile", 65536)         # 10 s x 8^2 = 640 s
    assert len(g.skipped) == 1 and g.skipped[0].startswith("64K (estimate 640 s")
