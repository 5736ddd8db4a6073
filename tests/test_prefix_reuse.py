"""Prefix reuse (kvcompile/kv/prefix.py): a request resumes at the longest common prefix of
its tokens and the history the Engine's store holds. For llama and qwen35 (hybrid: its
recurrent layers resume from the live state or a host checkpoint), all resident and
streamed, each reused run gives a cold Engine's greedy tokens and, step by step, its logits
to fp32 tolerance (bitwise where the reused rows came from prefill chunks: the resumed
prefill's chunks fall on the ubatch grid as a cold one's) when the prompts share the whole
history, diverge in the middle, are shorter, follow an interrupted stream, and follow
speculative rounds with rollbacks."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

import kvcompile.engine.engine as E
from kvcompile.engine.engine import Engine
from kvcompile.io.make_model import make_model

SEED = int.from_bytes(os.urandom(4), "little")
CTX, UB = 1024, 64


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("prefix")
    out = {}
    for arch in ("llama", "qwen35"):
        out[arch] = d / f"{arch}.gguf"
        make_model(arch, "tiny", out[arch], weight_type="f32", seed=SEED % 1000)
    return out


@contextlib.contextmanager
def recorded(logits: list):
    """Every step's logits the Engine's (host) sampler sees, in order."""
    base = E.Sampler

    class Recording(base):
        def __call__(self, row, history):
            logits.append(row.float().reshape(-1).clone())
            return super().__call__(row, history)

        def probs(self, row, history):
            logits.append(row.float().reshape(-1).clone())
            return super().probs(row, history)

    E.Sampler = Recording
    try:
        yield logits
    finally:
        E.Sampler = base


def run(engine, prompt, n=24, **kw):
    """(greedy token ids, the logits of every sampler call) of one request."""
    rows: list = []
    with recorded(rows):
        r = engine.generate(prompt, max_tokens=n, temperature=0, **kw)
    return r, rows


def engine(path, arena=0.0, **kw):
    if arena:
        kw["kv_stream_arena_mib"] = arena
    return Engine(str(path), ctx_size=CTX, ubatch=UB, progress=False, **kw)


def tiny_arena(e) -> float:
    from kvcompile.kv.kv_pages import min_arena_bytes
    full = e.model.layer_plan.kv_config(e.model.config)
    return min_arena_bytes(full, CTX) * 1.2 / 2 ** 20


def check(reused, cold, bitwise=False, ctx=()):
    """Greedy tokens equal, every step's logits within fp32 tolerance (or bitwise)."""
    (r, rows), (c, crows) = reused, cold
    assert r.token_ids == c.token_ids, (SEED, *ctx)
    assert len(rows) == len(crows)
    for a, b in zip(rows, crows):
        if bitwise:
            assert torch.equal(a, b), (SEED, *ctx, (a - b).abs().max().item())
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def ids(n, salt, vocab):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(SEED + salt)
                         ).tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
@pytest.mark.parametrize("where", ["resident", "streamed"])
@torch.inference_mode()
def test_reused_prefixes_give_a_cold_engines_tokens_and_logits(files, arch, where):
    path = files[arch]
    ref = engine(path)
    e = engine(path, tiny_arena(ref) if where == "streamed" else 0)
    v = ref.model.config.vocab_size
    prompt = ids(300, 1, v)

    def cold(p, n=24):
        ref.store.reset()
        return run(ref, p, n)

    first = run(e, prompt)
    check(first, cold(prompt), bitwise=True, ctx=(arch, where, "first"))
    # the same prompt again: its last prefill chunk again, cut as a cold prefill cuts it
    again = run(e, prompt)
    assert again[0].cached_tokens == (len(prompt) - 1) // UB * UB
    check(again, cold(prompt), bitwise=True, ctx=(arch, where, "same"))
    # the whole history and a new turn (the history's last rows came from decode steps)
    turn = prompt + again[0].token_ids + ids(40, 2, v)
    nxt = run(e, turn)
    held = len(prompt) + len(again[0].token_ids) - 1
    # on the ubatch grid; a hybrid with no checkpoint there resumes where its state stands
    assert nxt[0].cached_tokens in (held // UB * UB, held), nxt[0].cached_tokens
    check(nxt, cold(turn), ctx=(arch, where, "turn"))
    # the prompt, then something else: every reused row came from prefill chunks that fall
    # where a cold prefill's fall (the prompt's last chunk is computed again): bitwise
    branch = prompt + ids(40, 9, v)
    branched = run(e, branch)
    assert branched[0].cached_tokens == len(prompt) // UB * UB
    check(branched, cold(branch), bitwise=True, ctx=(arch, where, "branch"))
    # diverging in the middle
    fork = turn[:170] + ids(50, 3, v)
    forked = run(e, fork)
    assert 0 < forked[0].cached_tokens <= 170
    check(forked, cold(fork), ctx=(arch, where, "fork"))
    # a shorter prompt than the history
    short = fork[:120]
    shorter = run(e, short)
    assert 0 < shorter[0].cached_tokens < 120
    check(shorter, cold(short), ctx=(arch, where, "short"))
    # after an interrupted stream: the rows its forwards wrote are history
    s = e.stream(short + ids(30, 4, v), max_tokens=40, temperature=0)
    for _ in range(5):
        next(s)
    after = short + ids(30, 4, v) + [7, 8, 9]
    resumed = run(e, after)
    assert resumed[0].cached_tokens >= (len(short) + 29) // UB * UB
    check(resumed, cold(after), ctx=(arch, where, "interrupted"))
    with pytest.raises(kvcompile_errors().StreamInterruptedError):
        next(s)


def kvcompile_errors():
    import kvcompile.errors
    return kvcompile.errors


@pytest.mark.parametrize("arch,spec", [("llama", "ngram-simple"), ("qwen35", "draft-mtp"),
                                       ("qwen35", "ngram-simple,draft-mtp")])
@torch.inference_mode()
def test_a_history_left_by_speculative_rounds_is_reused_exactly(files, arch, spec):
    """Verify rounds with rollbacks truncate the store's rows (and restore a hybrid's
    recurrent state) to what was kept: the next request reuses that history and gives a
    cold Engine's tokens; an MTP drafter resumes its own layer's KV where it stood."""
    path = files[arch]
    ref = engine(path)
    e = engine(path, spec_type=spec, spec_ngram_size_n=1, spec_ngram_size_m=4,
               spec_draft_n_max=3, spec_draft_p_min=0.0)
    v = ref.model.config.vocab_size
    # distinct tokens over a fifth of the vocabulary: the ngram drafter (n=1) finds most
    # pending tokens earlier in the history, whatever the random model says
    unit = (torch.randperm(v - 3, generator=torch.Generator().manual_seed(SEED + 5))[:826]
            + 3).tolist()
    prompt = unit + unit[:4]
    a = run(e, prompt, 100)
    assert a[0].speculative["drafted"] > 0
    ref.store.reset()
    check(a, run(ref, prompt, 100), ctx=(arch, spec, "rounds"))
    turn = prompt + a[0].token_ids + unit[:7]
    b = run(e, turn, 24)
    # past the prompt: rows the verify rounds left are reused (a grid point inside them,
    # or where a hybrid's state stands)
    held = len(prompt) + len(a[0].token_ids) - 8
    assert b[0].cached_tokens >= held // UB * UB > len(prompt), b[0].cached_tokens
    ref.store.reset()
    c = run(ref, turn, 24)
    assert b[0].token_ids == c[0].token_ids, (SEED, arch, spec)


@torch.inference_mode()
def test_cache_prompt_off_and_the_checkpoint_budget(files):
    """cache_prompt=False starts every request cold; a hybrid store with no checkpoint
    slots resumes only where its live state stands, else cold, with the same tokens."""
    path = files["qwen35"]
    v = engine(path).model.config.vocab_size
    prompt = ids(200, 6, v)
    off = engine(path, cache_prompt=False)
    run(off, prompt)
    assert run(off, prompt)[0].cached_tokens == 0
    none = engine(path, ctx_checkpoints=0)
    a = run(none, prompt)
    again = run(none, prompt)                # no checkpoint before the last chunk: cold
    assert again[0].cached_tokens == 0 and again[0].token_ids == a[0].token_ids
    turn = prompt + again[0].token_ids + ids(10, 7, v)
    nxt = run(none, turn)                    # the live state stands where the turn goes on
    assert nxt[0].cached_tokens == len(prompt) + len(again[0].token_ids) - 1 or \
        nxt[0].cached_tokens == len(prompt) + len(again[0].token_ids)
    cold = engine(path, cache_prompt=False)
    check(nxt, run(cold, turn), ctx=("no checkpoints",))
