"""Speculative decoding of a hybrid model (qwen35: Gated DeltaNet + attention + an MTP layer).

- Rollback: after a verify step of depth 1..5, keeping any number of its rows, the recurrent
  state restored from the per-row checkpoints equals (bitwise) the state reached by decoding
  only the kept tokens one at a time, and so does the next step's logits (bf16 weights: on
  the CPU their matmuls give a row the same bits whatever the row count; fp32 GEMMs do not).
- The MTP drafter's first draft is the argmax of an fp64 dense MTP reference run over the
  whole prompt (so the MTP KV the drafter fed is complete and in the right positions).
- Greedy tokens with draft-mtp, ngram-simple and both equal plain decoding, all resident and
  streamed; an oracle drafter wrong at every depth 1..5 keeps them equal too.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from kvcompile.kv.store import KvStore
from kvcompile.engine.engine import Engine
from kvcompile.models.qwen35 import Qwen35Model
from kvcompile.executor.executor import Executor
from kvcompile.engine.speculative.decode import Drafter
from kvcompile.io.weights import load_weights
from tiny_hybrid import write_tiny_hybrid

SEED = int(os.environ.get("KVC_SEED", int.from_bytes(os.urandom(4), "little")))
VOCAB = 512
ARENAS = {"resident": 0, "streamed": 1.0}       # MiB; the tiny model's KV is ~2.3 MiB


@pytest.fixture(scope="module")
def hybrid_file(tmp_path_factory):
    return write_tiny_hybrid(tmp_path_factory.mktemp("spec") / "qwen35.gguf", SEED % 1000)


def _model(path, dtype=torch.float32) -> Qwen35Model:
    w = load_weights(path, progress=False)
    return Qwen35Model.from_weights(w.config, w.tensors, dtype=dtype)


def _ids(n, salt):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(SEED + salt)
                         ).tolist()


@pytest.mark.parametrize("programs", [False, True], ids=["model", "programs"])
@pytest.mark.parametrize("where", list(ARENAS))
@torch.inference_mode()
def test_rollback_equals_decoding_only_the_kept_tokens(hybrid_file, where, programs):
    """Verify steps of 2..6 rows (padded to 2, 4, 8: the padding rows' recurrence undone),
    each kept in part or whole, against decoding only the kept rows; programs: traced and
    captured (rerun on the CPU)."""
    model = _model(hybrid_file, torch.bfloat16)
    cache = KvStore.for_model(model, 512, "f32", "f32", ARENAS[where])
    runner = Executor(model, cache, ubatch=64, capture=programs, compile=programs,
                      strict=True)
    cache.recurrent.reserve_rows(8)       # as the Engine does: the widest program's rows
    prompt, start = _ids(100, 1), 100
    runner.begin_request(200)
    runner.step(prompt[:64], 0)
    runner.step(prompt[64:], 64)
    state = cache.recurrent
    before = state.snapshot()
    for depth in range(1, 6):
        rows = _ids(depth + 1, 10 + depth)       # the pending token + a draft of `depth`
        after = _ids(1, 20 + depth)              # the token a next step feeds
        for keep in range(1, depth + 2):
            state.restore(before)
            runner.verify(rows, start)
            runner.rollback(keep, depth + 1, start)
            if where == "streamed":       # the host history forgot the rejected rows
                assert {cache.history.rows[i] for i in runner.trunk} == {start + keep}
            got = (state.conv.clone(), state.ssm.clone())
            got_next = runner.step(after, start + keep, all_rows=True).clone()
            state.restore(before)
            for j in range(keep):
                runner.step(rows[j:j + 1], start + j)
            want = (state.conv.clone(), state.ssm.clone())
            want_next = runner.step(after, start + keep, all_rows=True)
            ctx = (SEED, where, depth, keep)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), ctx
            assert torch.equal(got_next, want_next), ctx
            assert state.n_tokens == start + keep + 1
    if programs:
        stats = runner.program_stats()
        assert {k for k in runner.programs if k[0] == "verify"} == {
            ("verify", 2), ("verify", 4), ("verify", 8)}, runner.programs
        assert stats["replays"] > 0 and "fallback" not in stats, stats


def test_verify_rows_cost_their_inputs_not_a_state_each():
    """At the seed-27b geometry a verify row records 4 MB of recurrence inputs over the 48
    GDN layers, not a 157 MB state: a depth-5 round (padded to 8 rows) and a 49-row ngram
    round (padded to 64) fit a 16 GiB budget's workspace beside the weights."""
    from kvcompile.engine.memory_budget import verify_outputs, workspace_bytes
    from kvcompile.io.gguf.synthetic import preset_config
    from kvcompile.kv.recurrent_state import RecurrentState
    from kvcompile.models.config import ModelConfig
    p = preset_config("qwen35", "seed-27b")
    c = ModelConfig(arch="qwen35", n_layers=p.n_layers, hidden=p.hidden, ffn=p.ffn,
                    n_heads=p.n_heads, n_kv_heads=p.n_kv_heads, head_dim=p.head_dim,
                    vocab_size=p.vocab_size, context_length=p.context_length,
                    rope_dim=p.rope_dim, full_attention_interval=4,
                    ssm_conv_kernel=p.conv_kernel, ssm_k_heads=p.gdn_k_heads,
                    ssm_v_heads=p.gdn_v_heads, ssm_head_dim=p.gdn_head_dim)
    cpu, gdn = torch.device("cpu"), 48
    state = gdn * 48 * 128 * 128 * 4                           # 151 MiB
    row = (workspace_bytes(c, 512, cpu, 8) - workspace_bytes(c, 512, cpu, 4)
           - verify_outputs(c, 8) + verify_outputs(c, 4)) / 4      # the logits apart
    assert row == gdn * 4 * (10240 + RecurrentState.row_floats(16, 48, 128)) < state / 25
    assert workspace_bytes(c, 512, cpu, 49) - workspace_bytes(c, 512, cpu, 0) < 0.4 * 2**30


@torch.inference_mode()
def test_wider_checkpoints_drop_the_verify_programs_over_the_old_ones(hybrid_file):
    """A verify step wider than the checkpoint buffers replaces them; the programs captured
    over the old buffers go (a replay would write checkpoints no rollback reads)."""
    model = _model(hybrid_file)
    cache = KvStore.for_model(model, 512, "f32", "f32", 0)
    runner = Executor(model, cache, ubatch=64, capture=True, compile=True, strict=True)
    prompt = _ids(64, 3)
    runner.begin_request(128)
    runner.step(prompt, 0)
    runner.verify(_ids(2, 4), 64)
    assert ("verify", 2) in runner.programs and cache.recurrent.checkpoint_rows == 2
    runner.rollback(1, 2, 64)
    runner.verify(_ids(3, 5), 65)
    assert cache.recurrent.checkpoint_rows == 4
    assert ("verify", 2) not in runner.programs and ("verify", 4) in runner.programs


@torch.inference_mode()
def test_first_mtp_draft_is_the_dense_references_argmax(hybrid_file):
    import gguf  # noqa: F401  (the reference reads the file with it)
    from test_mtp import _read, mtp_reference
    model = _model(hybrid_file)
    prompt = _ids(150, 2)
    e = Engine.from_model(model, ctx_size=512, ubatch=64, progress=False,
                          spec_type="draft-mtp", spec_draft_n_max=1, spec_draft_p_min=0.0)
    seen = []
    mtp = e.executor.mtp

    def record(ids, hidden, start):
        out = mtp(ids, hidden, start)
        seen.append((start, len(ids), out[0][-1].clone()))
        return out
    e.executor.mtp = record
    r = e.generate(prompt, max_tokens=3, temperature=0)
    first = r.token_ids[0]
    # prefill chunks feed positions 0..148; the first round feeds 149 and drafts from it
    assert [(s, n) for s, n, _ in seen[:4]] == [(0, 64), (64, 64), (128, 21), (149, 1)]
    seq = torch.tensor(prompt + [first])
    _, hidden = model(seq, torch.arange(len(seq)), KvStore.for_model(model, 512), return_hidden=True)
    md, w = _read(hybrid_file)
    ref = mtp_reference(md, w, seq[1:], hidden[:-1], torch.arange(len(seq) - 1))
    torch.testing.assert_close(seen[3][2].double(), ref[-1], rtol=1e-3, atol=1e-3)
    assert r.speculative["drafted"] == 1


@pytest.mark.parametrize("where", list(ARENAS))
@pytest.mark.parametrize("spec", ["draft-mtp", "ngram-simple", "ngram-simple,draft-mtp"])
def test_greedy_speculation_equals_plain(hybrid_file, spec, where):
    model = _model(hybrid_file)
    unit = _ids(19, 3)
    prompt = unit * 8 + unit[:4]
    opts = dict(ctx_size=512, ubatch=64, progress=False, kv_stream_arena_mib=ARENAS[where])
    plain = Engine.from_model(model, **opts).generate(prompt, max_tokens=48, temperature=0)
    e = Engine.from_model(model, spec_type=spec, spec_ngram_size_n=1, spec_ngram_size_m=4,
                          spec_draft_n_max=1 + SEED % 5, spec_draft_p_min=0.0, **opts)
    for _ in range(2):                      # a second request on the same Engine
        r = e.generate(prompt, max_tokens=48, temperature=0)
        s = r.speculative
        assert r.token_ids == plain.token_ids, (SEED, spec, where)
        assert s["forwards"] + 1 + s["accepted"] == r.completion_tokens
        assert s["drafted"] > 0, s


class OracleDrafter(Drafter):
    """Proposes the known greedy continuation, with the token at a scheduled depth replaced:
    rounds cycle through draft lengths 1..5 and every error depth (or none)."""

    def __init__(self, continuation, prompt_len):
        self.cont, self.n0 = continuation, prompt_len
        self.plan = [(d, bad) for d in range(1, 6) for bad in range(d + 1)]
        self.round = 0
        self.kept = []

    def propose(self, history, limit):
        d, bad = self.plan[self.round % len(self.plan)]
        self.round += 1
        at = len(history) - self.n0            # index of the next token in cont
        draft = self.cont[at:at + min(d, limit)]
        if bad < len(draft):
            draft[bad] = (draft[bad] + 1) % VOCAB
        self.expect = min(bad, len(draft))
        return draft


@pytest.mark.parametrize("where", list(ARENAS))
def test_oracle_drafts_rejected_at_every_depth_keep_tokens_equal(hybrid_file, where):
    model = _model(hybrid_file)
    prompt = _ids(90, 4)
    opts = dict(ctx_size=512, ubatch=64, progress=False, kv_stream_arena_mib=ARENAS[where])
    plain = Engine.from_model(model, **opts).generate(prompt, max_tokens=80, temperature=0)
    e = Engine.from_model(model, spec_type="ngram-simple", spec_ngram_size_m=5, **opts)
    oracle = OracleDrafter(plain.token_ids, len(prompt))
    accepted = []
    record = oracle.accepted
    oracle.accepted = lambda s, em, h: (accepted.append((oracle.expect, len(em) - 1)),
                                        record(s, em, h))
    e.spec = SimpleNamespace(drafter=lambda runner: oracle, enabled=True, uses_mtp=False)
    r = e.generate(prompt, max_tokens=80, temperature=0)
    assert r.token_ids == plain.token_ids, (SEED, where)
    assert oracle.round >= 20 and r.speculative["accepted"] > 0
    assert all(want == got for want, got in accepted), accepted    # each round's prefix


@pytest.mark.parametrize("where", list(ARENAS))
@torch.inference_mode()
def test_every_mtp_step_matches_a_dense_replay(hybrid_file, where):
    """Each MTP step the drafter runs (backlog feeds and chained drafts, rounds after the
    first included) gives the last-row logits of the same rows run over a fresh cache whose
    MTP KV was written the way the drafter must have written it: the verified rows (the
    trunk's hidden states, paired with the next token) up to the step, then the round's
    chain. Catches a wrong pairing or position however rarely drafts are accepted."""
    model = _model(hybrid_file)
    unit = _ids(13, 7)
    prompt = unit * 6
    e = Engine.from_model(model, ctx_size=400, ubatch=64, progress=False,
                          kv_stream_arena_mib=ARENAS[where], spec_type="ngram-simple,draft-mtp",
                          spec_ngram_size_n=1, spec_ngram_size_m=5, spec_draft_n_max=3,
                          spec_draft_p_min=0.0)
    calls, mtp = [], e.executor.mtp

    def record(ids, hidden, start):
        out = mtp(ids, hidden, start)
        calls.append((list(ids), hidden.clone(), start, out[0][-1].clone()))
        return out
    e.executor.mtp = record
    r = e.generate(prompt, max_tokens=100, temperature=0)
    seq = torch.tensor(prompt + r.token_ids)
    _, trunk = model(seq, torch.arange(len(seq)), KvStore.for_model(model, 512), return_hidden=True)
    chain = []
    kinds = {"feed": 0, "chain": 0}
    for ids, hidden, start, logits in calls:
        n = len(ids)
        feed = (ids == seq[start + 1:start + 1 + n].tolist()
                and torch.allclose(hidden, trunk[start:start + n], atol=1e-4))
        cache = KvStore.for_model(model, 512)
        if feed:
            chain = []
            ref = model.mtp_forward(seq[1:start + n + 1], trunk[:start + n],
                                    torch.arange(start + n), cache)[-1]
        else:
            assert not chain or start == chain[-1][2] + 1, (SEED, start)
            s0 = chain[0][2] if chain else start
            model.mtp_forward(seq[1:s0 + 1], trunk[:s0], torch.arange(s0), cache)
            for c_ids, c_hidden, c_start in chain:
                model.mtp_forward(torch.tensor(c_ids), c_hidden, torch.arange(c_start, c_start + 1),
                                  cache)
            ref = model.mtp_forward(torch.tensor(ids), hidden, torch.arange(start, start + n),
                                    cache)[-1]
            chain.append((ids, hidden, start))
        kinds["feed" if feed else "chain"] += 1
        torch.testing.assert_close(logits, ref, rtol=1e-3, atol=1e-3, msg=f"{SEED} {start}")
    assert kinds["feed"] >= 5 and kinds["chain"] >= 5, kinds


@pytest.mark.parametrize("spec", ["ngram-simple", "draft-mtp"])
def test_max_tokens_zero_generates_nothing(hybrid_file, spec):
    e = Engine.from_model(_model(hybrid_file), ctx_size=256, progress=False, spec_type=spec)
    r = e.generate(_ids(20, 8), max_tokens=0, temperature=0)
    assert r.completion_tokens == 0 and r.token_ids == []


def test_an_engine_built_without_draft_mtp_refuses_it_clearly(hybrid_file):
    """The MTP layer gets pages only with an MTP drafter: switching one on later says what to
    change, and the Engine keeps serving."""
    from kvcompile.engine.speculative.options import SpecOptions
    from kvcompile.errors import KvcompileError
    e = Engine.from_model(_model(hybrid_file), ctx_size=256, progress=False)
    plain = e.generate(_ids(20, 9), max_tokens=4, temperature=0)
    e.spec = SpecOptions.checked("draft-mtp")
    with pytest.raises(KvcompileError, match="spec_type including draft-mtp"):
        e.generate(_ids(20, 9), max_tokens=4, temperature=0)
    e.spec = SpecOptions.checked("none")
    assert e.generate(_ids(20, 9), max_tokens=4, temperature=0).token_ids == plain.token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("where", list(ARENAS))
@pytest.mark.parametrize("spec", ["ngram-simple", "draft-mtp", "ngram-simple,draft-mtp"])
def test_greedy_speculation_equals_plain_cuda(hybrid_file, spec, where):
    """The CUDA path: fla's recurrent kernel row by row with checkpoints; ngram-simple
    alternates decode-graph replays (one-row steps) with checkpointed verify steps and
    rollbacks; with MTP the verify steps return their hidden rows and the MTP draft steps
    are captured programs of their own. fp32 weights (a different row count may round
    differently; fp32 keeps that far below the logit gaps)."""
    w = load_weights(hybrid_file, progress=False)
    model = Qwen35Model.from_weights(w.config, w.tensors, dtype=torch.float32, device="cuda")
    unit = _ids(19, 6)
    prompt = unit * 8 + unit[:4]
    opts = dict(ctx_size=512, ubatch=64, progress=False, kv_stream_arena_mib=ARENAS[where])
    plain = Engine.from_model(model, **opts).generate(prompt, max_tokens=40, temperature=0)
    e = Engine.from_model(model, spec_type=spec, spec_ngram_size_n=1, spec_ngram_size_m=4,
                          spec_draft_n_max=5, spec_draft_p_min=0.0, **opts)
    for _ in range(2):
        r = e.generate(prompt, max_tokens=40, temperature=0)
        assert r.token_ids == plain.token_ids, (SEED, spec, where)
        assert r.speculative["drafted"] > 0
    assert e.executor.request_stats()["replays"] > 0
    captured = {kind for (kind, rows), progs in e.executor.programs.items() if progs}
    assert ("mtp" in captured) == ("draft-mtp" in spec), (SEED, spec, captured)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_wide_ngram_rounds_equal_plain(hybrid_file, device):
    """ngram drafts of up to 24 tokens: verify steps of up to 25 rows run the step of 32
    padded rows (on CUDA the traced forward, uncaptured, each GDN layer's rows through fla's
    recurrence in one call), streamed; the greedy tokens equal plain decoding's."""
    w = load_weights(hybrid_file, progress=False)
    model = Qwen35Model.from_weights(w.config, w.tensors, dtype=torch.float32, device=device)
    # every token of the vocabulary once: whatever token the model says, the ngram drafter
    # finds it in the prompt and drafts the (up to 24) tokens after it
    prompt = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(SEED)).tolist()
    opts = dict(ctx_size=1024, ubatch=64, progress=False, kv_stream_arena_mib=ARENAS["streamed"])
    plain = Engine.from_model(model, **opts).generate(prompt, max_tokens=40, temperature=0)
    e = Engine.from_model(model, spec_type="ngram-simple", spec_ngram_size_n=1,
                          spec_ngram_size_m=24, **opts)
    r = e.generate(prompt, max_tokens=40, temperature=0)
    assert r.token_ids == plain.token_ids, (SEED, device)
    wide = {rows for (kind, rows) in e.executor.programs if rows > 8}
    assert wide and r.speculative["drafted"] > 24, (SEED, list(e.executor.programs),
                                                   r.speculative)
