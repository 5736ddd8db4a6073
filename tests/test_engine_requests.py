"""An Engine's requests from several threads, streams that end early, and requests whose
answer is not what the model computes: one at a time in arrival order, a clear end for
each, a clear error for a corrupt model."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from kvcompile.engine.engine import Engine
from kvcompile.errors import KvcompileError, ModelFileError, StreamInterruptedError


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from kvcompile.io.make_model import make_model
    path = tmp_path_factory.mktemp("tiny") / "llama.gguf"
    make_model("llama", "tiny", path, weight_type="f32", seed=11)
    return path


@pytest.fixture(scope="module")
def engine(tiny_path):
    return Engine(str(tiny_path), ctx_size=256, progress=False)


def prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng()
    return [[int(t) for t in rng.integers(5, 200, size=int(rng.integers(3, 30)))]
            for _ in range(n)]


def test_eight_threads_get_their_own_answers(engine):
    """8 threads x 25 requests over one Engine: each answer equals the same request run
    alone; nothing interleaves (each request holds the store until it ends)."""
    asks = prompts(8)
    alone = [engine.generate(p, max_tokens=5, temperature=0).token_ids for p in asks]
    got = {i: [] for i in range(8)}
    errors = []

    def worker(i):
        try:
            for _ in range(25):
                got[i].append(engine.generate(asks[i], max_tokens=5, temperature=0).token_ids)
        except BaseException as e:          # reported below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for i in range(8):
        assert got[i] == [alone[i]] * 25, i


def run_in_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()))
    t.start()
    return t, out


def test_another_thread_waits_for_an_open_stream(engine):
    p = prompts(2)
    alone = engine.generate(p[1], max_tokens=4, temperature=0).token_ids
    s = engine.stream(p[0], max_tokens=20, temperature=0)
    next(s)
    t, out = run_in_thread(lambda: engine.generate(p[1], max_tokens=4, temperature=0))
    t.join(timeout=1.0)
    assert t.is_alive() and "r" not in out     # waiting: the stream holds the Engine
    s.close()                                  # gives it back
    t.join(timeout=60)
    assert out["r"].token_ids == alone


def test_a_dropped_stream_gives_the_engine_back(engine):
    p = prompts(1)[0]
    s = engine.stream(p, max_tokens=4, temperature=0)         # never read
    del s
    t, out = run_in_thread(lambda: engine.generate(p, max_tokens=4, temperature=0))
    t.join(timeout=60)
    assert not t.is_alive() and len(out["r"].token_ids) <= 4


def test_an_interrupted_stream_keeps_what_it_gave(engine):
    p = prompts(2)
    with engine.stream(p[0], max_tokens=12, temperature=0) as old:
        pieces = [next(old) for _ in range(3)]
        newer = engine.generate(p[1], max_tokens=3, temperature=0)   # same thread: takes over
        with pytest.raises(StreamInterruptedError, match="newer request"):
            next(old)
    assert old.result.finish_reason == "interrupted"
    # (a token may give no piece of text yet: an unfinished UTF-8 sequence)
    assert old.result.text == "".join(pieces) and old.result.completion_tokens >= 3
    assert newer.completion_tokens <= 3


def test_a_full_context_ends_as_context(engine):
    p = prompts(1)[0]
    r = engine.generate(p, max_tokens=1000, temperature=0)
    if r.finish_reason != "stop":
        assert r.finish_reason == "context" and len(p) + r.completion_tokens == 256
    r = engine.generate(p, max_tokens=2, temperature=0)
    assert r.finish_reason in ("length", "stop")


def test_no_tokens_asked_reports_the_prefill_only(engine):
    r = engine.generate(prompts(1)[0], max_tokens=0, temperature=0)
    line = r.stats_line()
    assert r.completion_tokens == 0 and "first token" not in line and "prefill took" in line


@pytest.mark.parametrize("options,words", [
    (dict(ctx=64), "did you mean 'ctx_size'"),
    (dict(threads=0), "threads"),
], ids=["unknown-option", "threads-0"])
def test_engine_options_say_what_to_change(options, words):
    with pytest.raises(KvcompileError, match=words):
        Engine(None, **options)


def test_a_config_that_is_not_one_is_refused():
    with pytest.raises(KvcompileError, match="EngineConfig"):
        Engine(None, {"ctx_size": 64})


def test_temperature_must_be_finite(engine):
    from kvcompile.errors import SamplingError
    with pytest.raises(SamplingError, match="finite"):
        engine.stream([5, 6], temperature=float("inf"))


def poison(path, out, tensor: str) -> None:
    """A copy of the GGUF at `path` with tensor `tensor`'s bytes all 0xff (NaN floats)."""
    from gguf import GGUFReader
    t = next(t for t in GGUFReader(str(path)).tensors if t.name == tensor)
    data = bytearray(path.read_bytes())
    data[t.data_offset:t.data_offset + t.n_bytes] = b"\xff" * t.n_bytes
    out.write_bytes(bytes(data))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_weights_are_named(tiny_path, tmp_path, temperature):
    bad = tmp_path / "bad.gguf"
    poison(tiny_path, bad, "blk.1.ffn_down.weight")
    e = Engine(str(bad), ctx_size=64, progress=False)
    with pytest.raises(ModelFileError, match=r"weight \S*1\S*down\S* holds NaN"):
        e.generate([5, 6, 7], max_tokens=4, temperature=temperature)
    with pytest.raises(ModelFileError):                # and again: it keeps answering
        e.generate([8, 9], max_tokens=2, temperature=temperature)


def test_the_cli_names_nan_weights_and_exits_1(tiny_path, tmp_path):
    import subprocess
    import sys
    bad = tmp_path / "bad.gguf"
    poison(tiny_path, bad, "blk.0.attn_q.weight")
    for temperature in ("0", "0.8"):
        r = subprocess.run([sys.executable, "-m", "kvcompile", "generate", "-m", str(bad),
                            "hello there", "-n", "4", "--temperature", temperature,
                            "--no-progress"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert "weight blocks.0" in r.stderr and "NaN" in r.stderr, r.stderr


def test_a_waiter_that_gives_up_leaves_the_queue():
    """A thread interrupted while it waits its turn (KeyboardInterrupt in the main thread,
    any exception out of the wait) takes its ticket out of the line: the threads behind it
    still get the Engine."""
    from kvcompile.engine.gate import RequestGate
    gate = RequestGate()
    held = gate.enter()                       # this thread holds the gate
    wait = gate._cond.wait

    def interrupted(timeout=None):
        gate._cond.wait = wait                # (once)
        raise KeyboardInterrupt

    gate._cond.wait = interrupted
    t, out = run_in_thread(lambda: pytest.raises(KeyboardInterrupt, gate.enter))
    t.join(timeout=10)
    assert not t.is_alive() and "r" in out
    t, out = run_in_thread(gate.enter)        # next in line
    t.join(timeout=0.5)
    gate.leave(held)
    t.join(timeout=10)
    assert not t.is_alive() and gate.holds(out["r"])


def test_a_stream_that_fails_to_start_gives_the_engine_back(engine, monkeypatch):
    """An exception after the request took its turn but before its stream exists (an
    asynchronous KeyboardInterrupt, a failure building the stream) leaves no ticket holding
    the Engine: another thread's request still runs."""
    import kvcompile.engine.engine as eng

    def broken(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(eng, "TokenStream", broken)
    p = prompts(1)[0]
    with pytest.raises(KeyboardInterrupt):
        engine.stream(p, max_tokens=2, temperature=0)
    monkeypatch.undo()
    t, out = run_in_thread(lambda: engine.generate(p, max_tokens=2, temperature=0))
    t.join(timeout=60)
    assert not t.is_alive() and len(out["r"].token_ids) <= 2


def test_an_engines_fixed_threads_hold_beside_another_engine(tiny_path):
    """torch's thread count is the process's: an Engine built with threads=N runs its steps
    with N threads even after another Engine (built later, or adjusting to the load) set
    another count."""
    import torch
    one = Engine(str(tiny_path), ctx_size=64, progress=False, threads=1)
    Engine(str(tiny_path), ctx_size=64, progress=False, threads=2)      # sets 2
    seen = []
    step = one.executor.step
    one.executor.step = lambda *a, **k: seen.append(torch.get_num_threads()) or step(*a, **k)
    one.generate([5, 6, 7], max_tokens=2, temperature=0)
    assert seen and set(seen) == {1}


def test_a_cancelled_request_stops_within_a_chunk(tiny_path):
    """Another thread sets the request's cancel event during a long prefill: the request
    ends at the next chunk ("cancelled"), keeps what it computed, and the Engine serves on."""
    e = Engine(str(tiny_path), ctx_size=2048, ubatch=16, progress=False)
    cancel = threading.Event()
    chunks = []
    forward = e.forward

    def counting(ids, start):
        chunks.append(start)
        if len(chunks) == 3:
            cancel.set()                   # as if a client went away mid-prefill
        return forward(ids, start)
    e.forward = counting
    prompt = prompts(1)[0] * 60
    r = e.generate(prompt, max_tokens=8, temperature=0, cancel=cancel)
    assert r.finish_reason == "cancelled" and r.completion_tokens == 0
    assert len(chunks) == 3 and e.store.rows() == 48          # three chunks, then no more
    e.forward = forward
    again = e.generate(prompt, max_tokens=3, temperature=0)   # resumes what was computed
    assert again.cached_tokens == 48 and again.finish_reason in ("length", "stop")
    cancel2 = threading.Event()
    s = e.stream(prompt, max_tokens=50, temperature=0, cancel=cancel2)
    cancel2.set()
    assert list(s) == [] or len(s.result.token_ids) <= 1
    assert s.result.finish_reason == "cancelled"


def test_a_default_engine_after_one_with_fixed_threads(tiny_path, monkeypatch):
    """The first Engine of the process built with threads=N, then one with the default:
    the default's ceiling is the process's count from before any Engine set one (it was
    None: a TypeError out of min())."""
    import torch
    from kvcompile.engine import threads
    monkeypatch.setitem(threads._process, "set", None)          # a fresh process
    monkeypatch.setitem(threads._process, "ceiling", None)
    before = torch.get_num_threads()
    Engine(str(tiny_path), ctx_size=64, progress=False, threads=2)
    e = Engine(str(tiny_path), ctx_size=64, progress=False)
    assert e.threads.cores == min(threads.physical_cores(), before)
    e.generate([5, 6, 7], max_tokens=1, temperature=0)


def test_a_quantized_weight_is_checked_a_chunk_at_a_time(monkeypatch):
    """(CUDA keeps block-format weights: the check dequantizes a run of rows at a time, so
    it needs no room for a whole weight.) A NaN block scale in row 157 of 300 is found."""
    from gguf import GGMLQuantizationType, quants

    from kvcompile.engine import finite
    from kvcompile.models.quant_weight import QuantWeight
    w = np.random.default_rng().standard_normal((300, 256)).astype(np.float32)
    raw = quants.quantize(w, GGMLQuantizationType.Q8_0).view(np.uint8).reshape(300, -1)
    q = QuantWeight.from_gguf_rows(__import__("torch").from_numpy(raw.copy()), "Q8_0", 256)
    monkeypatch.setattr(finite, "CHUNK_ELEMENTS", 1000)
    assert finite._quant_finite(q)
    q.planar[157].fill_(255)
    assert not finite._quant_finite(q)
