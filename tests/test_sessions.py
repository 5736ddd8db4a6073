"""Saved sessions and the prompt cache: a history taken off the store (kv/snapshot.py) and
put back, in memory (other conversations) or on disk (another process), resumes exactly as
the store's own history does; files of another model, of a newer format or torn are
refused; a failed write leaves the previous file whole."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from kvcompile.engine.engine import Engine
from kvcompile.errors import SessionError
from kvcompile.io.make_model import make_model

UB = 64


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    out = {}
    for arch in ("llama", "qwen35"):
        out[arch] = d / f"{arch}.gguf"
        make_model(arch, "tiny", out[arch], weight_type="f32", seed=21)
    out["other"] = d / "other.gguf"
    make_model("llama", "tiny", out["other"], weight_type="f32", seed=22)   # same geometry
    return out


def ids(n, v=4000):
    return [int(t) for t in np.random.default_rng().integers(5, v, size=n)]


def engine(path, arena=0, **options):
    return Engine(str(path), ctx_size=2560, ubatch=UB, kv_stream_arena_mib=arena,
                  progress=False, **options)


RESTORE = """
import json, sys
from kvcompile.engine.engine import Engine
path, session, arena, kv, turn = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5])
e = Engine(path, ctx_size=2560, ubatch=64, kv_stream_arena_mib=arena, progress=False,
           cache_type_k=kv, cache_type_v=kv)
held = e.load_session(session)
r = e.generate(turn, max_tokens=12, temperature=0)
print(json.dumps(dict(held=held, cached=r.cached_tokens, tokens=r.token_ids)))
"""


@pytest.mark.parametrize("arch,arena,kv", [("llama", 0, "f32"), ("llama", 4, "q8_0"),
                                           ("qwen35", 0, "q4_0"), ("qwen35", 4, "f32")],
                         ids=["llama-resident-f32", "llama-streamed-q8_0",
                              "qwen35-resident-q4_0", "qwen35-streamed-f32"])
def test_a_session_resumes_in_a_new_process(models, tmp_path, arch, arena, kv):
    """Save after a 2K prompt, restore in a new process, continue: the tokens of an
    uninterrupted run, from the same resume point, with no prefill of the history."""
    e = engine(models[arch], arena, cache_type_k=kv, cache_type_v=kv)
    prompt = ids(2048)
    first = e.generate(prompt, max_tokens=6, temperature=0)
    info = e.save_session(tmp_path / "s.session")
    assert info["tokens"] >= len(prompt)
    turn = prompt + first.token_ids + ids(9)
    want = e.generate(turn, max_tokens=12, temperature=0)
    r = subprocess.run([sys.executable, "-c", RESTORE, str(models[arch]),
                        str(tmp_path / "s.session"), str(arena), kv, json.dumps(turn)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["held"] == info["tokens"]
    assert got["cached"] == want.cached_tokens >= (len(prompt) // UB) * UB
    assert got["tokens"] == want.token_ids


def test_sessions_that_do_not_fit_are_refused(models, tmp_path):
    e = engine(models["llama"])
    e.generate(ids(300), max_tokens=4, temperature=0)
    good = tmp_path / "good.session"
    e.save_session(good)
    checks = {
        "another model": (engine(models["other"]), good, "another model"),
        "another architecture": (engine(models["qwen35"]), good, "another model"),
        "another KV layout": (engine(models["llama"], cache_type_k="q8_0"), good,
                              "another KV layout"),
    }
    torn = tmp_path / "torn.session"
    torn.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    checks["truncated"] = (e, torn, "truncated")
    newer = tmp_path / "newer.session"
    rewrite_format(good, newer, 99)
    checks["newer format"] = (e, newer, "format 99")
    for what, (target, path, words) in checks.items():
        before = target.store.prefix.tokens[:]
        with pytest.raises(SessionError, match=words):
            target.load_session(path)
        assert target.store.prefix.tokens == before, what      # the history is untouched
    with pytest.raises(SessionError, match="no session file"):
        e.load_session(tmp_path / "missing.session")


def rewrite_format(src, dst, fmt: int) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    m = json.loads(meta["kvcompile-session"])
    m["format"] = fmt
    save_file(tensors, str(dst), metadata={"kvcompile-session": json.dumps(m)})


def test_a_failed_write_leaves_the_previous_file(models, tmp_path, monkeypatch):
    import safetensors.torch
    e = engine(models["llama"])
    e.generate(ids(200), max_tokens=3, temperature=0)
    path = tmp_path / "s.session"
    e.save_session(path)
    before = path.read_bytes()
    e.generate(ids(500), max_tokens=3, temperature=0)

    def crash(tensors, filename, metadata=None):       # half a file, then the process dies
        with open(filename, "wb") as f:
            f.write(b"\0" * 1000)
        raise OSError("injected crash")
    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(OSError, match="injected"):
        e.save_session(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["s.session"]      # no temporary left


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_two_conversations_taking_turns_keep_their_histories(models, arch):
    """The prompt cache: A, B, A's next turn, B's next turn: each resumes its own history
    (cold without the cache), with the tokens of a cold run."""
    e = engine(models[arch])
    a, b = ids(10 * UB), ids(9 * UB)     # the reused rows all come from prefill: bitwise
    ra = e.generate(a, max_tokens=5, temperature=0)
    rb = e.generate(b, max_tokens=5, temperature=0)
    a2 = a + ra.token_ids + ids(20)
    b2 = b + rb.token_ids + ids(20)
    ra2 = e.generate(a2, max_tokens=6, temperature=0)
    rb2 = e.generate(b2, max_tokens=6, temperature=0)
    assert ra2.cached_tokens == len(a2) // UB * UB and rb2.cached_tokens == len(b2) // UB * UB
    assert e.prompt_cache.nbytes <= e.prompt_cache.budget
    cold = engine(models[arch], cache_ram_gib=0)
    cold.generate(a, max_tokens=5, temperature=0)
    cold.generate(b, max_tokens=5, temperature=0)
    again = cold.generate(a2, max_tokens=6, temperature=0)
    assert again.cached_tokens == 0 and again.token_ids == ra2.token_ids


def test_the_prompt_cache_keeps_to_its_budget(models):
    one = engine(models["llama"], cache_ram_gib=0)
    one.generate(ids(700), max_tokens=2, temperature=0)
    from kvcompile.kv.snapshot import take
    size = take(one.store).nbytes
    e = engine(models["llama"], cache_ram_gib=1.5 * size / 2**30)   # room for one
    convs = [ids(700) for _ in range(3)]
    for c in convs:
        e.generate(c, max_tokens=2, temperature=0)
    assert len(e.prompt_cache.entries) == 1 and e.prompt_cache.nbytes <= e.prompt_cache.budget
    assert e.prompt_cache.entries[0].tokens[:700] == convs[1]      # the most recent one


def rewrite(src, dst, edit) -> None:
    """dst: src's tensors and metadata after edit(tensors, meta) changed them in place."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(str(src), framework="pt") as f:
        meta = json.loads(f.metadata()["kvcompile-session"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors, meta)
    save_file(tensors, str(dst), metadata={"kvcompile-session": json.dumps(meta)})


@pytest.mark.parametrize("arena", [0, 4], ids=["resident", "streamed"])
def test_odd_session_files_are_refused_before_the_store_changes(models, tmp_path, arena):
    """Files whose tensors do not fit their metadata or this store (missing tensors, rows
    beyond the pages given, more pages than this Engine's context holds, pages of another
    width or dtype, a state of another shape) raise SessionError and leave the history as
    it was: never a KeyError or an index error half way through, never rows that read
    pages the file did not give (the last conversation's KV)."""
    import torch
    e = engine(models["llama"], arena)
    e.generate(ids(300), max_tokens=4, temperature=0)
    good = tmp_path / "good.session"
    e.save_session(good)
    layer = str(e.store.layers[0])

    def drop(name):
        return lambda t, m: t.pop(name)

    def meta(key, value):
        return lambda t, m: m.__setitem__(key, value)

    def rows(n):
        return lambda t, m: m["rows"].__setitem__(layer, n)

    def pages(fn):
        return lambda t, m: t.__setitem__(f"pages.{layer}", fn(t[f"pages.{layer}"]))

    edits = {
        "no tokens": drop("tokens"),
        "no pages": drop(f"pages.{layer}"),
        "no rows": lambda t, m: m.pop("rows"),
        "no identity": lambda t, m: m.pop("identity"),
        "a layer missing": lambda t, m: m["rows"].pop(layer),
        "rows beyond the pages": rows(600),
        "negative rows": rows(-5),
        "rows not a number": rows("many"),
        "pages of another width": pages(lambda p: p[:, :16].contiguous()),
        "pages of another dtype": pages(lambda p: p.view(torch.int16)),
        "metadata not an object": lambda t, m: (m.clear(), m.update(format=1, identity=[])),
    }
    small = engine(models["llama"], arena)          # same layout, a context of 2560
    small.generate(ids(200), max_tokens=2, temperature=0)
    for what, edit in edits.items():
        bad = tmp_path / "bad.session"
        rewrite(good, bad, edit)
        before = (small.store.prefix.tokens[:], dict(small.store.history.rows))
        with pytest.raises(SessionError):
            small.load_session(bad)
        assert (small.store.prefix.tokens, dict(small.store.history.rows)) == before, what
    # a session longer than this Engine's context: same layout, more pages than it holds
    short = Engine(str(models["llama"]), ctx_size=256, ubatch=UB, kv_stream_arena_mib=arena,
                   progress=False)
    short.generate(ids(100), max_tokens=2, temperature=0)
    before = short.store.prefix.tokens[:]
    with pytest.raises(SessionError, match="context"):
        short.load_session(good)
    assert short.store.prefix.tokens == before


def test_a_history_over_the_budget_is_not_copied(models, monkeypatch):
    """A live history larger than the whole prompt cache cannot be kept: it is not copied
    off the store (a copy of the whole KV history, thrown away) when a new conversation
    comes."""
    import kvcompile.kv.prompt_cache as pc
    taken = []
    real = pc.take
    monkeypatch.setattr(pc, "take", lambda store: taken.append(1) or real(store))
    e = engine(models["llama"], cache_ram_gib=1 / 2**30)      # a budget of one byte
    e.generate(ids(700), max_tokens=2, temperature=0)
    e.generate(ids(700), max_tokens=2, temperature=0)          # a new conversation
    assert not e.prompt_cache.entries and not taken
    roomy = engine(models["llama"])                            # and with room, it is kept
    roomy.generate(ids(700), max_tokens=2, temperature=0)
    roomy.generate(ids(700), max_tokens=2, temperature=0)
    assert len(taken) == 1 and len(roomy.prompt_cache.entries) == 1
    assert pc.held_nbytes(roomy.store) == real(roomy.store).nbytes       # the estimate


def test_a_cold_request_keeps_the_live_conversation(models):
    """A request with cache_prompt=False computes from position 0, but the conversation
    the store held goes to the prompt cache first (as a new conversation's would): its
    next turn still resumes."""
    e = engine(models["llama"])
    a = ids(10 * UB)
    ra = e.generate(a, max_tokens=3, temperature=0)
    cold = e.generate(ids(5 * UB), max_tokens=3, temperature=0, cache_prompt=False)
    assert cold.cached_tokens == 0
    a2 = a + ra.token_ids + ids(20)
    assert e.generate(a2, max_tokens=3, temperature=0).cached_tokens == len(a2) // UB * UB


def test_two_threads_saving_one_path_both_succeed(models, tmp_path, monkeypatch):
    """save_session writes outside the Engine's turn: two threads saving to the same path
    at once each write their own temporary file (one of the two whole files wins), instead
    of sharing one (a rename of the other's half-written file, or a missing one)."""
    import threading
    import safetensors.torch
    e = engine(models["llama"])
    e.generate(ids(200), max_tokens=3, temperature=0)
    real, both = safetensors.torch.save_file, threading.Barrier(2, timeout=30)

    def save_file(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        both.wait()                       # both temporaries written before either renames
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    path, errors = tmp_path / "s.session", []

    def save():
        try:
            e.save_session(path)
        except BaseException as err:
            errors.append(err)
    threads = [threading.Thread(target=save) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert [p.name for p in tmp_path.iterdir()] == ["s.session"]
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    assert engine(models["llama"]).load_session(path) > 0


def test_a_session_name_of_255_bytes_saves(models, tmp_path):
    """The server takes file names up to 255 bytes (a file system's limit): the temporary
    file beside the target must not be longer than the longest name it allows."""
    e = engine(models["llama"])
    e.generate(ids(100), max_tokens=2, temperature=0)
    path = tmp_path / ("s" * 255)
    assert e.save_session(path)["tokens"] > 0
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["llama", "qwen35"])
@pytest.mark.parametrize("arena", [0, 4], ids=["resident", "streamed"])
def test_histories_move_on_and_off_a_cuda_store(models, tmp_path, arch, arena):
    """On CUDA (pinned host history, captured steps, pipelined decode): a conversation's
    history saved, another conversation run, the session loaded back: the next turn resumes
    it and gives the tokens of the same Engine that never left it; two conversations taking
    turns through the prompt cache likewise. fp32 weights keep rounding far below the
    logit gaps."""
    opts = dict(ctx_size=2560, ubatch=UB, kv_stream_arena_mib=arena, progress=False,
                device="cuda", dtype="f32", cache_type_k="q8_0", cache_type_v="q4_0")
    e = Engine(str(models[arch]), **opts)
    a, b = ids(10 * UB), ids(9 * UB)
    ra = e.generate(a, max_tokens=5, temperature=0)
    e.save_session(tmp_path / "a.session")
    a2 = a + ra.token_ids + ids(20)
    want = e.generate(a2, max_tokens=8, temperature=0)          # never left the store
    e.generate(b, max_tokens=5, temperature=0)                  # another conversation
    assert e.load_session(tmp_path / "a.session") >= len(a)
    got = e.generate(a2, max_tokens=8, temperature=0)
    assert got.cached_tokens == want.cached_tokens == len(a2) // UB * UB
    assert got.token_ids == want.token_ids
    # the prompt cache: b's next turn swaps b's history back in
    rb = e.generate(b, max_tokens=5, temperature=0)
    b2 = b + rb.token_ids + ids(20)
    e.generate(a2 + ids(30), max_tokens=3, temperature=0)
    back = e.generate(b2, max_tokens=6, temperature=0)
    assert back.cached_tokens == len(b2) // UB * UB
    cold = Engine(str(models[arch]), cache_prompt=False, **opts)
    assert back.token_ids == cold.generate(b2, max_tokens=6, temperature=0).token_ids


def test_loading_a_session_keeps_the_live_conversation(models, tmp_path):
    """The history held when a session loads goes to the prompt cache: its next turn
    still resumes it."""
    e = engine(models["llama"])
    a, b = ids(8 * UB), ids(8 * UB)
    e.generate(a, max_tokens=3, temperature=0)
    e.save_session(tmp_path / "a.session")
    rb = e.generate(b, max_tokens=3, temperature=0)
    e.load_session(tmp_path / "a.session")
    b2 = b + rb.token_ids + ids(10)
    assert e.generate(b2, max_tokens=3, temperature=0).cached_tokens == len(b2) // UB * UB
