"""Engine end to end on the default model: greedy output equals llama.cpp's on the exact
F32 oracle file, streaming equals the final text, stop rules, and bad requests that leave
the engine serving."""
import numpy as np
import pytest

from kvcompile.engine.engine import Engine
from kvcompile.errors import ContextLengthError, KvcompileError, SamplingError

PROMPT = "The old bridge over the river was built of"


@pytest.fixture(scope="module")
def engine():
    return Engine(None, ctx_size=512, progress=False)


def llama_cpp_greedy_text(path, prompt_ids, n):
    from llama_cpp import Llama
    llm = Llama(model_path=str(path), n_ctx=512, type_k=0, type_v=0, n_threads=2,
                logits_all=True, verbose=False)
    llm.eval(prompt_ids)
    out = []
    for _ in range(n):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if tok == llm.token_eos():
            break
        out.append(tok)
        llm.eval([tok])
    return out


def test_greedy_generate_matches_llama_cpp_on_f32_oracle(engine, smollm2_f32_path):
    r = engine.generate(PROMPT, max_tokens=24, temperature=0)
    want = llama_cpp_greedy_text(smollm2_f32_path, engine.tokenizer.encode(PROMPT), 24)
    print("ours:", repr(r.text), "\nllama.cpp ids equal:", r.token_ids == want)
    assert r.token_ids == want
    assert r.prompt_tokens == len(engine.tokenizer.encode(PROMPT))
    assert r.completion_tokens == 24 and r.finish_reason == "length"
    assert r.prefill_tok_s > 0 and r.decode_tok_s > 0


def test_stream_pieces_join_to_text_and_decode(engine):
    s = engine.stream(PROMPT, max_tokens=20, temperature=0.9, seed=3)
    pieces = list(s)
    assert "".join(pieces) == s.result.text
    assert s.result.text == engine.tokenizer.decode(s.result.token_ids)
    again = engine.generate(PROMPT, max_tokens=20, temperature=0.9, seed=3)
    assert again.token_ids == s.result.token_ids            # same seed, same tokens


def test_stop_string_truncates_and_finishes(engine):
    full = engine.generate(PROMPT, max_tokens=24, temperature=0)
    words = full.text.split()
    stop = words[3]                                          # a word that does appear
    r = engine.generate(PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert r.finish_reason == "stop"
    assert r.text == full.text[: full.text.find(stop)]


def test_chat_messages_end_at_end_of_turn(engine):
    r = engine.generate(messages=[{"role": "user", "content": "Say hello."}], max_tokens=64,
                        temperature=0)
    print(repr(r.text), r.finish_reason)
    assert r.finish_reason == "stop" and "<|im_end|>" not in r.text and r.text.strip()


def test_context_fills_up_with_length_finish(engine):
    ids = engine.tokenizer.encode("word " * 400)[:500]
    prompt = engine.tokenizer.decode(ids)
    n_prompt = len(engine.tokenizer.encode(prompt))
    r = engine.generate(prompt, max_tokens=100, temperature=0)
    assert r.finish_reason in ("length", "stop")
    assert n_prompt + r.completion_tokens <= engine.ctx_size


@pytest.mark.parametrize("bad,error,words", [
    (dict(prompt="word " * 1200), ContextLengthError, "ctx-size"),
    (dict(prompt=PROMPT, temperature=-1.0), SamplingError, "temperature"),
    (dict(prompt=PROMPT, top_p=1.5), SamplingError, "top_p"),
    (dict(prompt=PROMPT, top_k=-2), SamplingError, "top_k"),
    (dict(prompt=""), KvcompileError, "empty"),
    (dict(messages=[{"content": "no role"}]), KvcompileError, "role"),
    (dict(prompt=[1, 2, 10**7]), KvcompileError, "token ids"),
    (dict(prompt=[]), KvcompileError, "empty"),
    (dict(prompt=PROMPT, max_token=3), SamplingError, "unknown option.*max_token"),
], ids=["too-long", "neg-temperature", "top-p", "top-k", "empty", "bad-message",
        "id-out-of-vocab", "no-ids", "unknown-option"])
def test_bad_request_raises_then_engine_keeps_serving(engine, bad, error, words):
    before = engine.generate(PROMPT, max_tokens=8, temperature=0).token_ids
    with pytest.raises(error, match=words) as info:
        engine.generate(**bad)
    print(type(info.value).__name__, info.value)
    assert engine.generate(PROMPT, max_tokens=8, temperature=0).token_ids == before


def test_prompt_of_token_ids_equals_the_same_text(engine):
    ids = engine.tokenizer.encode(PROMPT)
    by_ids = engine.generate(ids, max_tokens=8, temperature=0)
    assert by_ids.prompt_tokens == len(ids)
    assert by_ids.token_ids == engine.generate(PROMPT, max_tokens=8, temperature=0).token_ids


def test_ctx_size_beyond_model_limit_is_refused(monkeypatch):
    """From the model file's header, before its weights load."""
    import kvcompile.engine.engine as engine_module

    def no_load(*a, **k):
        raise AssertionError("the weights were loaded before ctx_size was checked")
    monkeypatch.setattr(engine_module, "load_model", no_load)
    with pytest.raises(ContextLengthError, match="--ctx-size"):
        Engine(None, ctx_size=10**6, progress=False)


def test_streamed_kv_through_tiny_arena_equals_all_resident(engine):
    from kvcompile.kv.kv_pages import min_arena_bytes
    need = min_arena_bytes(engine.model.config, 512) / 2**20
    streamed = Engine(None, ctx_size=512, kv_stream_arena_mib=need * 1.05, progress=False)
    prompt = "A short story about a lighthouse keeper: " * 6
    want = engine.generate(prompt, max_tokens=16, temperature=0)
    got = streamed.generate(prompt, max_tokens=16, temperature=0)
    print(f"arena {need * 1.05:.2f} MiB:", got.kv)
    assert got.token_ids == want.token_ids
    assert got.kv["streamed_fraction"] >= 0.9 and got.kv["h2d_bytes"] > 0


def test_arena_too_small_names_the_smallest_that_works():
    from kvcompile.errors import ArenaError
    with pytest.raises(ArenaError, match="MiB") as info:
        Engine(None, ctx_size=512, kv_stream_arena_mib=0.01, progress=False)
    print(info.value)


def test_one_call_api_routes_every_engine_option():
    """kvcompile.generate(..., cuda_graphs=True) reaches Engine, not the sampler."""
    from kvcompile import api
    engine_opts, request = api._split(dict(cuda_graphs=True, ctx_size=64, trace=False,
                                           max_tokens=3, seed=1))
    assert engine_opts == dict(cuda_graphs=True, ctx_size=64, trace=False)
    assert request == dict(max_tokens=3, seed=1)


def test_newer_request_interrupts_an_unfinished_stream(engine):
    """Two streams share one cache: the older one stops with a clear error instead of
    continuing over the newer request's KV; the newer one is exact."""
    from kvcompile.errors import StreamInterruptedError
    want = engine.generate(PROMPT, max_tokens=6, temperature=0).token_ids
    old = engine.stream("Once upon a time", max_tokens=6, temperature=0)
    next(old)
    new = engine.stream(PROMPT, max_tokens=6, temperature=0)
    with pytest.raises(StreamInterruptedError, match="newer request"):
        next(old)
    list(new)
    assert new.result.token_ids == want


@pytest.mark.parametrize("options,error,words", [
    (dict(device="foo"), "DeviceError", "not a device name"),
    (dict(device="cuda:99"), "DeviceError", "(?i)cuda"),
    (dict(ctx_size=0), "ContextLengthError", "positive integer"),
    (dict(ubatch=0), "KvcompileError", "--ubatch-size"),
    (dict(cache_type_k="q3_k"), "KvLayoutError", "unsupported KV cache type"),
    (dict(kv_stream_arena_mib=-1), "ArenaError", "--kv-stream-arena-mib"),
], ids=["device-name", "device-index", "ctx-0", "ubatch-0", "cache-type", "arena"])
def test_engine_options_refused_before_loading(options, error, words, monkeypatch):
    import kvcompile.engine.engine as engine_module
    from kvcompile import errors

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")
    monkeypatch.setattr(engine_module, "load_model", no_load)
    with pytest.raises(getattr(errors, error), match=words) as info:
        Engine(None, progress=False, **options)
    print(type(info.value).__name__, info.value)


def test_request_edge_values(engine, monkeypatch, capsys):
    plain = engine.generate(PROMPT, max_tokens=4, temperature=0)
    assert engine.generate(PROMPT, max_tokens=4, temperature=0, stop=None).token_ids == \
        plain.token_ids
    with pytest.raises(SamplingError, match="seed"):
        engine.stream(PROMPT, seed=2 ** 64)
    # a prefill progress bar from PREFILL_BAR_TOKENS prompt tokens on, with progress on
    import kvcompile.engine.engine as engine_module
    monkeypatch.setattr(engine_module, "PREFILL_BAR_TOKENS", 4)
    monkeypatch.setattr(engine, "progress", True)
    engine.store.reset()                     # cold: the whole prompt prefills again
    again = engine.generate(PROMPT, max_tokens=4, temperature=0)
    assert "prefill" in capsys.readouterr().err and again.token_ids == plain.token_ids


def test_stream_paused_at_its_last_piece_is_interrupted_too(engine):
    """Even with no forward left to run, the older stream's result would mix in the newer
    request's telemetry: it raises as well."""
    from kvcompile.errors import StreamInterruptedError
    old = engine.stream(PROMPT, max_tokens=1, temperature=0)
    next(old)
    list(engine.stream("Hello", max_tokens=2, temperature=0))
    with pytest.raises(StreamInterruptedError):
        list(old)


def test_one_call_api_reuses_its_engine_and_follows_progress(monkeypatch):
    from kvcompile import api

    class FakeEngine:
        built = 0

        def __init__(self, model, **options):
            FakeEngine.built += 1
            self.progress = options.get("progress", True)
    monkeypatch.setattr(api, "Engine", FakeEngine)
    monkeypatch.setattr(api, "_cached", None)
    first = api._engine(None, dict(ctx_size=64))
    quiet = api._engine(None, dict(ctx_size=64, progress=False))
    assert quiet is first and FakeEngine.built == 1 and quiet.progress is False
    assert api._engine(None, dict(ctx_size=64)).progress is True
    assert api._engine(None, dict(ctx_size=128)) is not first and FakeEngine.built == 2


def test_stats_time_steps_to_the_tokens_read(engine, monkeypatch):
    """The decode rate and step times count each step until its token is read, as a device
    that finishes a step after its launches return would make the sampler wait: a sampler
    slowed by 20 ms stands in for that wait, and the stats agree within 5% with the token
    times seen outside the engine (a clock stopped when forward returns reads ~20 ms a step
    fast)."""
    import time

    import kvcompile.engine.engine as E
    seen = []

    class SlowSampler(E.Sampler):
        def __call__(self, logits, history):
            time.sleep(0.02)
            token = super().__call__(logits, history)
            seen.append(time.perf_counter())
            return token

    monkeypatch.setattr(E, "Sampler", SlowSampler)
    t0 = time.perf_counter()
    r = engine.generate(PROMPT, max_tokens=12, temperature=0)
    assert r.completion_tokens == 12 and len(r.step_s) == 11 and len(seen) == 12
    outside = 11 / (seen[-1] - seen[0])
    print(f"decode {r.decode_tok_s:.2f} tok/s, outside {outside:.2f}; {r.stats_line()}")
    assert abs(r.decode_tok_s / outside - 1) < 0.05
    assert r.prefill_s <= seen[0] - t0 and r.prefill_s > 0.02
    steps = r.step_ms()
    assert 20 <= steps["p50"] <= steps["p90"] <= steps["max"]
    assert r.stats()["ttft_s"] == r.prefill_s and "step p50" in r.stats_line()


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
@pytest.mark.parametrize("arena", [0, 1.5], ids=["resident", "streamed"])
def test_a_dropped_engine_frees_its_store_at_once(tmp_path, arch, arena):
    """No reference cycle through the store, its policy, its prefix state or the executor's
    programs: its (device) memory goes back when the last reference does, not at some
    later garbage collection."""
    import gc
    import weakref
    from kvcompile.io.make_model import make_model
    path = tmp_path / f"{arch}.gguf"
    make_model(arch, "tiny", path, weight_type="f32", seed=3)
    gc.collect()
    gc.disable()
    try:
        e = Engine(str(path), ctx_size=1024, progress=False, kv_stream_arena_mib=arena,
                   cuda_graphs=True)
        e.generate(list(range(5, 300)), max_tokens=5, temperature=0)
        store, executor = weakref.ref(e.store), weakref.ref(e.executor)
        del e
        assert store() is None and executor() is None
    finally:
        gc.enable()
