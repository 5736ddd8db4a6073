"""kvcompile serve (kvcompile/server/, docs/server.md): a server started here on 127.0.0.1
over a tiny synthetic llama (random weights, SmolLM2's tokenizer and chat template), spoken
to with the official `openai` client and with httpx."""
from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
parser = pytest.importorskip("prometheus_client.parser")

from kvcompile.engine.engine import Engine                                  # noqa: E402
from kvcompile.errors import KvcompileError                                 # noqa: E402
from kvcompile.io.make_model import make_model                              # noqa: E402
from kvcompile.server.app import ServerSettings, create_app                 # noqa: E402
from kvcompile.server.cli_serve import add_serve_parser                     # noqa: E402

MODEL = "tiny"
CTX, UBATCH = 2048, 16
GREEDY = dict(temperature=0, max_tokens=12)
HELLO = [{"role": "user", "content": "Hello! What is a page table?"}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    make_model("llama", "tiny", path, weight_type="f32", seed=7)
    return str(path)


@pytest.fixture(scope="module")
def engine(model_path):
    """The live history only (no prompt cache of other conversations): cached_tokens
    counts what the last request left."""
    return Engine(model_path, ctx_size=CTX, ubatch=UBATCH, cache_ram_gib=0, progress=False)


@contextlib.contextmanager
def serving(engine, **settings):
    """A uvicorn server on a free port in a thread; yields its base URL and the app's
    Server; stops it after."""
    app = create_app(engine, ServerSettings(model_name=MODEL, **settings))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not answer /health"
        time.sleep(0.02)
    try:
        yield SimpleNamespace(base=base, server=app.state.server)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def srv(engine, tmp_path_factory):
    with serving(engine, slot_save_path=tmp_path_factory.mktemp("slots")) as s:
        yield s


def client(srv) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{srv.base}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def metrics(srv) -> dict:
    """Every sample of /metrics: (name, sorted label items) -> value."""
    text = httpx.get(f"{srv.base}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parser.text_string_to_metric_families(text) for s in family.samples}


def usage_of(result) -> dict:
    return dict(prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
                total_tokens=result.prompt_tokens + result.completion_tokens)


def check_usage(usage, direct) -> None:
    assert dict(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                total_tokens=usage.total_tokens) == usage_of(direct)
    assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


# ---- OpenAI's API, against engine.generate ---------------------------------------------------
def test_chat_equals_generate(srv, engine):
    r = client(srv).chat.completions.create(model=MODEL, messages=HELLO, **GREEDY)
    direct = engine.generate(messages=HELLO, **GREEDY)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == direct.text
    assert r.choices[0].finish_reason == direct.finish_reason == "length"
    check_usage(r.usage, direct)


def test_chat_stream_equals_generate(srv, engine):
    chunks = list(client(srv).chat.completions.create(
        model=MODEL, messages=HELLO, stream=True, stream_options={"include_usage": True},
        **GREEDY))
    direct = engine.generate(messages=HELLO, **GREEDY)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == direct.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == []                 # the usage chunk comes last
    check_usage(chunks[-1].usage, direct)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_equals_generate(srv, engine, stream):
    prompt = "The three laws of thermodynamics are"
    opts = dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, seed=11, max_tokens=10,
                repeat_penalty=1.1)
    extra = dict(top_k=opts["top_k"], min_p=opts["min_p"], repeat_penalty=opts["repeat_penalty"])
    common = dict(model=MODEL, prompt=prompt, temperature=opts["temperature"],
                  top_p=opts["top_p"], seed=opts["seed"], max_tokens=opts["max_tokens"],
                  extra_body=extra)
    direct = engine.generate(prompt, **opts)
    if stream:
        chunks = list(client(srv).completions.create(
            stream=True, stream_options={"include_usage": True}, **common))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        check_usage(chunks[-1].usage, direct)
    else:
        r = client(srv).completions.create(**common)
        assert r.object == "text_completion" and r.id.startswith("cmpl-")
        text = r.choices[0].text
        check_usage(r.usage, direct)
    assert text == direct.text


@pytest.mark.slow
def test_default_model_equals_kvcompile_generate():
    """The issue's acceptance as written: the default model, the one-call API."""
    import kvcompile

    question = [{"role": "user", "content": "Name three colors."}]
    with serving(Engine(None, progress=False)) as s:
        c = client(s)
        whole = c.chat.completions.create(model=MODEL, messages=question, max_tokens=16,
                                          temperature=0)
        chunks = list(c.chat.completions.create(
            model=MODEL, messages=question, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True}))
    direct = kvcompile.generate(messages=question, max_tokens=16, temperature=0,
                                progress=False)
    assert whole.choices[0].message.content == direct.text
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == direct.text
    assert whole.choices[0].finish_reason == direct.finish_reason
    check_usage(whole.usage, direct)
    assert chunks[-1].usage.completion_tokens == direct.completion_tokens


def test_token_ids_stop_strings_and_models(srv, engine):
    ids = engine.tokenizer.encode("Once upon a time")
    greedy = engine.generate(ids, max_tokens=16, temperature=0).text
    stop = greedy[len(greedy) // 2:len(greedy) // 2 + 3]
    r = client(srv).completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0,
                                       stop=[stop, "never seen"])
    direct = engine.generate(ids, max_tokens=16, temperature=0, stop=(stop, "never seen"))
    assert r.choices[0].text == direct.text and stop not in direct.text
    assert r.choices[0].finish_reason == "stop"
    models = client(srv).models.list()
    assert [m.id for m in models.data] == [MODEL]


# ---- one engine, many clients -----------------------------------------------------------------
def test_concurrent_clients_get_their_own_answers(srv):
    prompts = [[{"role": "user", "content": f"Question {i}: name {i + 2} colors."}]
               for i in range(4)]
    c = client(srv)

    def ask(messages):
        return c.chat.completions.create(model=MODEL, messages=messages,
                                         **GREEDY).choices[0].message.content
    single = [ask(m) for m in prompts]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, [prompts[i % 4] for i in range(8)]))
    assert answers == [single[i % 4] for i in range(8)]


HELD = "Go on and on."       # greedy on the test model: no end of text before 1984 tokens


def open_stream(base, max_tokens):
    """A streamed completion held open: (the httpx client, the response, its lines), once its
    first piece has come (the request runs)."""
    c = httpx.Client(base_url=base, timeout=60)
    r = c.send(c.build_request("POST", "/v1/completions", json={
        "prompt": HELD, "max_tokens": max_tokens, "temperature": 0,
        "stream": True}), stream=True)
    assert r.status_code == 200
    lines = r.iter_lines()
    assert next(line for line in lines if line.startswith("data: "))
    return c, r, lines


def wait_for(predicate, what: str, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_full_queue_answers_503(engine):
    with serving(engine, queue_size=1) as s, ThreadPoolExecutor(1) as pool:
        c, held, _ = open_stream(s.base, CTX - 64)
        waiting = pool.submit(httpx.post, f"{s.base}/v1/completions", timeout=60,
                              json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
        wait_for(lambda: s.server.worker.depth == 1, "the second request never queued")
        r = httpx.post(f"{s.base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        held.close()                               # the held stream's client goes away
        c.close()
        assert waiting.result().status_code == 200


def test_disconnect_frees_the_engine(srv, engine):
    step_s = engine.generate("Warm up", max_tokens=17, temperature=0).decode_s / 16
    before = metrics(srv)[("kvcompile_requests_cancelled_total", ())]
    n = CTX - 64
    c, held, _ = open_stream(srv.base, n)
    held.close()                                   # disconnect mid-stream
    c.close()
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{srv.base}/v1/completions", timeout=60, json={
            "prompt": "Next!", "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        first = next(lines)
        ttft = time.perf_counter() - t0
        rest = list(lines)
    assert json.loads(first[6:])["choices"][0]["text"] and rest[-1] == "data: [DONE]"
    # had the held stream run to its end, the next request would have waited for n steps
    assert ttft < 0.25 * n * step_s, (ttft, n * step_s)
    assert metrics(srv)[("kvcompile_requests_cancelled_total", ())] == before + 1


# ---- errors --------------------------------------------------------------------------------
def _bad_requests() -> list[tuple[str, str, bytes]]:
    """(method, path, body) of 50+ requests the server must refuse with a 4xx."""
    chat, text = "/v1/chat/completions", "/v1/completions"
    msgs = [{"role": "user", "content": "hi"}]
    out = [("POST", chat, raw) for raw in (b"{", b"", b"[1, 2", b"{'a': 1}", b"nul",
                                           b"\xff\xfe{}", b'{"messages": "\xc3\x28"}',
                                           b"[]", b"42", b'"text"')]
    wrong = [("temperature", "hot"), ("top_p", "0.5"), ("top_k", 1.5), ("top_k", "4"),
             ("min_p", True), ("seed", "7"), ("seed", 1.5), ("stream", "yes"),
             ("stream_options", "usage"), ("stream_options", {"include_usage": 1}),
             ("max_tokens", "5"), ("max_tokens", 2.5), ("max_completion_tokens", "5"),
             ("stop", 5), ("stop", [1]), ("repeat_penalty", "1"), ("cache_prompt", "no"),
             ("n", "1"), ("model", 5), ("messages", "hi"), ("messages", [1]),
             ("messages", [{"role": 1, "content": "x"}]),
             ("messages", [{"role": "user", "content": 5}]),
             ("messages", [{"role": "user", "content": [{"type": "image_url"}]}]),
             ("messages", []), ("n", 2), ("n", 0), ("model", "gpt-4o"), ("max_tokens", -1),
             ("max_tokens", 10**12), ("max_completion_tokens", -5), ("temperature", -1),
             ("top_p", 0), ("top_p", 2), ("min_p", 2), ("top_k", -1), ("repeat_penalty", 0),
             ("seed", 2**70), ("messages", [{"role": "user", "content": "x " * (CTX + 10)}])]
    out += [("POST", chat, json.dumps({"messages": msgs, **{k: v}}).encode())
            for k, v in wrong]
    out += [("POST", text, json.dumps(b).encode()) for b in (
        {"prompt": ""}, {"prompt": 5}, {"prompt": {"a": 1}}, {"prompt": [[1], [2]]},
        {"prompt": [10**9]}, {"prompt": []}, {}, {"prompt": "x", "model": "nope"},
        {"prompt": "x " * (CTX + 10)})]
    out.append(("POST", text, b'{"prompt": "' + b"x" * (10 * 10**6) + b'"}'))   # 10 MB
    slot = "/slots/0?action=save"
    out += [("POST", slot, json.dumps({"filename": n}).encode()) for n in (
        "../escape", "a/b", "..", ".hidden", "", "a\\b", "x" * 300, "a\x00b", 5,
        "/etc/passwd")]
    out += [("POST", "/slots/1?action=save", b'{"filename": "a"}'),
            ("POST", "/slots/0?action=explode", b'{"filename": "a"}'),
            ("GET", "/v1/nothing", b""), ("GET", chat, b""), ("PUT", "/v1/models", b"")]
    return out


def test_malformed_requests_get_json_errors(srv, engine):
    bad = _bad_requests()
    assert len(bad) >= 50
    with httpx.Client(base_url=srv.base, timeout=60) as c:
        for method, path, body in bad:
            r = c.request(method, path, content=body)
            assert 400 <= r.status_code < 500, (path, body[:80], r.status_code, r.text[:200])
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
        r = c.post("/v1/chat/completions", json={"messages": HELLO, **GREEDY})
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == \
        engine.generate(messages=HELLO, **GREEDY).text


def test_error_shapes(srv):
    c = client(srv)
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=2)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="x " * (CTX + 10), max_tokens=2)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=HELLO, n=2)
    assert e.value.param == "n"


def test_api_key_and_slots_off(engine):
    with serving(engine, api_key="sesame") as s:
        r = httpx.post(f"{s.base}/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{s.base}/health").status_code == 200
        r = client(s).with_options(api_key="sesame").completions.create(
            model=MODEL, prompt="x", max_tokens=1)
        assert r.usage.completion_tokens == 1
        r = httpx.post(f"{s.base}/slots/0?action=save", json={"filename": "a"},
                       headers={"Authorization": "Bearer sesame"})
        assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]


# ---- metrics and the prompt cache ------------------------------------------------------------
def test_metrics_parse_and_move(srv):
    before = metrics(srv)
    r = client(srv).completions.create(model=MODEL, prompt="Count: one two", max_tokens=5,
                                       temperature=0)
    after = metrics(srv)
    ok = ("kvcompile_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    assert after[ok] == before.get(ok, 0) + 1
    for name, n in [("kvcompile_prompt_tokens_total", r.usage.prompt_tokens),
                    ("kvcompile_completion_tokens_total", 5),
                    ("kvcompile_prompt_tokens_cached_total",
                     r.usage.prompt_tokens_details.cached_tokens),
                    ("kvcompile_time_to_first_token_seconds_count", 1)]:
        assert after[(name, ())] == before[(name, ())] + n, name
    assert after[("kvcompile_queue_depth", ())] == 0
    assert after[("kvcompile_kv_arena_bytes", ())] > 0
    assert after[("kvcompile_decode_tokens_per_second", ())] > 0
    assert after[("kvcompile_prefill_tokens_per_second", ())] > 0


def test_multi_turn_chat_prefills_only_the_new_turn(srv):
    c = client(srv)
    messages = [{"role": "system", "content": "You are terse."}]
    last_prompt = 0
    for turn in range(6):
        messages.append({"role": "user", "content": f"Turn {turn}: tell me more about "
                                                    f"paging, part {turn}."})
        r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                      temperature=0)
        cached = r.usage.prompt_tokens_details.cached_tokens
        prefilled, new = r.usage.prompt_tokens - cached, r.usage.prompt_tokens - last_prompt
        if turn:
            assert cached > 0 and cached % UBATCH == 0, (turn, cached)
            assert 1 <= prefilled <= new + UBATCH, (turn, prefilled, new)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        last_prompt = r.usage.prompt_tokens
    cold = c.chat.completions.create(model=MODEL, messages=messages[:-1], max_tokens=8,
                                     temperature=0, extra_body={"cache_prompt": False})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert cold.choices[0].message.content == messages[-1]["content"]


def test_interleaved_conversations_keep_their_cache(model_path):
    """With a prompt cache (--cache-ram), two conversations taking turns each resume their
    own history."""
    engine = Engine(model_path, ctx_size=CTX, ubatch=UBATCH, cache_ram_gib=0.25,
                    progress=False)
    with serving(engine) as s:
        c = client(s)
        talks = {name: [{"role": "system", "content": f"You are {name}, a {kind} guide."}]
                 for name, kind in (("Ada", "patient"), ("Bob", "quick"))}
        last = {}
        for turn in range(3):
            for name, messages in talks.items():
                messages.append({"role": "user", "content": f"{name}, turn {turn}: go on."})
                r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                              temperature=0)
                cached = r.usage.prompt_tokens_details.cached_tokens
                if turn:
                    assert cached >= last[name] - UBATCH, (name, turn, cached, last[name])
                last[name] = r.usage.prompt_tokens
                messages.append({"role": "assistant",
                                 "content": r.choices[0].message.content})


# ---- saved sessions ------------------------------------------------------------------------
def test_slot_save_erase_restore_continues(srv, engine):
    """Save a conversation, erase the slot, restore it: the next turn resumes from the
    restored history and gives what it gives without the round trip."""
    c = client(srv)
    first = HELLO + [{"role": "assistant", "content": c.chat.completions.create(
        model=MODEL, messages=HELLO, **GREEDY).choices[0].message.content}]
    with httpx.Client(base_url=srv.base, timeout=60) as h:
        saved = h.post("/slots/0?action=save", json={"filename": "conv-1.session"})
        assert saved.status_code == 200, saved.text
        assert saved.json()["filename"] == "conv-1.session" and saved.json()["n_written"] > 0
        assert saved.json()["n_saved"] > 0
        assert h.post("/slots/0?action=erase").status_code == 200
        restored = h.post("/slots/0?action=restore", json={"filename": "conv-1.session"})
        assert restored.status_code == 200, restored.text
        assert restored.json()["n_restored"] == saved.json()["n_saved"]
        missing = h.post("/slots/0?action=restore", json={"filename": "nope"})
        assert missing.status_code == 404
        (srv.server.settings.slot_save_path / "torn.session").write_bytes(b"not a session")
        torn = h.post("/slots/0?action=restore", json={"filename": "torn.session"})
        assert torn.status_code == 400 and torn.json()["error"]["code"] == "invalid_session"
        # a whole safetensors file that lacks a session's tensor: a 400 too, not a 500
        from safetensors import safe_open
        from safetensors.torch import save_file
        folder = srv.server.settings.slot_save_path
        with safe_open(str(folder / "conv-1.session"), framework="pt") as f:
            meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys() if k != "tokens"}
        save_file(tensors, str(folder / "odd.session"), metadata=meta)
        odd = h.post("/slots/0?action=restore", json={"filename": "odd.session"})
        assert odd.status_code == 400 and odd.json()["error"]["code"] == "invalid_session"
    follow = first + [{"role": "user", "content": "And a TLB?"}]
    r = c.chat.completions.create(model=MODEL, messages=follow, **GREEDY)
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    assert r.choices[0].message.content == engine.generate(messages=follow, **GREEDY).text


# ---- the command line and the import ---------------------------------------------------------
def _serve_args(argv):
    """`kvcompile serve ARGV` as cli.py adds it (with generate's model and KV flags)."""
    from kvcompile import cli

    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers(), cli._add_model_options, cli._engine_options)
    return p.parse_args(["serve", *argv])


@pytest.mark.parametrize("argv,message", [
    (["a.gguf", "-m", "b.gguf"], "the model once"), (["--queue", "0"], "--queue"),
    (["--port", "70000"], "--port"), (["--slot-save-path", "/no/such/dir"], "no such folder"),
    (["--max-body-mib", "0"], "--max-body-mib")])
def test_serve_command_refuses_before_loading(argv, message):
    args = _serve_args(argv)
    with pytest.raises(KvcompileError, match=message):
        args.func(args)


def test_serve_command_takes_the_shared_flags():
    args = _serve_args(["m.gguf", "-c", "4096", "-ctk", "q8_0", "--queue", "3", "--alias",
                        "x", "--cache-ram", "0.5", "--no-cache-prompt"])
    assert (args.model_file, args.ctx_size, args.cache_type_k, args.queue, args.alias,
            args.cache_ram, args.cache_prompt) == ("m.gguf", 4096, "q8_0", 3, "x", 0.5, False)


def test_server_is_imported_lazily():
    code = ("import sys, kvcompile, kvcompile.server.cli_serve; "
            "heavy = [m for m in sys.modules if m.split('.')[0] in "
            "('starlette', 'uvicorn', 'prometheus_client', 'torch') "
            "or m in ('kvcompile.server.app', 'kvcompile.api')]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_timings_and_token_ids(srv, engine):
    """llama.cpp's extras: `timings` beside `usage`, the choice's token ids on request."""
    body = dict(prompt=[5, 6, 7, 8, 9], max_tokens=4, temperature=0, return_tokens=True)
    r = httpx.post(f"{srv.base}/v1/completions", json=body, timeout=60).json()
    t, u = r["timings"], r["usage"]
    assert t["prompt_n"] + t["cache_n"] == u["prompt_tokens"] and t["prompt_ms"] > 0
    assert t["predicted_n"] == u["completion_tokens"] == len(r["choices"][0]["tokens"])
    want = engine.generate([5, 6, 7, 8, 9], max_tokens=4, temperature=0).token_ids
    assert r["choices"][0]["tokens"] == want
