"""Chunked Gated DeltaNet (prefill) equals the token-by-token recurrence (decode)."""
import math

import pytest
import torch
import torch.nn.functional as F

from kvcompile.models.gated_deltanet import (causal_conv, expand_key_heads, gdn_chunked,
                                             gdn_recurrent)


def _inputs(t, hk, hv, d, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q = F.normalize(r(t, hk, d), dim=-1)
    k = F.normalize(r(t, hk, d), dim=-1)
    v = r(t, hv, d)
    # decays spanning fast (exp(-3)) to slow (exp(-0.01)) forgetting
    g = -torch.exp(torch.empty(t, hv, dtype=torch.float64).uniform_(-4.6, 1.1, generator=gen))
    beta = torch.sigmoid(r(t, hv))
    state = r(hv, d, d) * 0.3
    return [x.to(dtype) for x in (q, k, v, g, beta, state)]


@pytest.mark.parametrize("t,hk,hv,d,chunk", [(1, 2, 2, 16, 64), (100, 2, 6, 32, 64),
                                              (257, 4, 4, 64, 64), (50, 1, 3, 32, 16)])
def test_chunked_equals_recurrent(t, hk, hv, d, chunk):
    q, k, v, g, beta, s0 = _inputs(t, hk, hv, d, seed=t * 7 + hv)
    scale = 1 / math.sqrt(d)
    o_ref, s_ref = gdn_recurrent(*(x.double() for x in (q, k, v, g, beta, s0)), scale=scale)
    o_rec, s_rec = gdn_recurrent(q, k, v, g, beta, s0, scale=scale)
    o_chk, s_chk = gdn_chunked(q, k, v, g, beta, s0, scale=scale, chunk=chunk)
    errs = {name: (a.double() - o_ref).abs().max().item() / o_ref.abs().max().item()
            for name, a in (("recurrent", o_rec), ("chunked", o_chk))}
    s_err = (s_chk.double() - s_ref).abs().max().item() / s_ref.abs().max().item()
    print(f"T={t} Hk={hk} Hv={hv} D={d}: rel max err vs fp64 {errs}, state {s_err:.2e}, "
          f"|o| max {o_ref.abs().max().item():.3f}")
    assert errs["recurrent"] < 1e-5 and errs["chunked"] < 1e-5 and s_err < 1e-5
    assert (o_chk - o_rec).abs().max() < 1e-4 * o_ref.abs().max()


def test_split_prefill_then_decode_equals_one_pass():
    # prefill 70 tokens chunked, then 30 decode steps from the carried state
    q, k, v, g, beta, s0 = _inputs(100, 2, 4, 32, seed=3)
    scale = 1 / math.sqrt(32)
    o_all, s_all = gdn_chunked(q, k, v, g, beta, s0, scale)
    o_a, s_a = gdn_chunked(q[:70], k[:70], v[:70], g[:70], beta[:70], s0, scale)
    o_b, s_b = gdn_recurrent(q[70:], k[70:], v[70:], g[70:], beta[70:], s_a, scale)
    err = (torch.cat([o_a, o_b]) - o_all).abs().max().item()
    print(f"split vs one pass: max err {err:.2e}, state err {(s_b - s_all).abs().max():.2e}")
    assert err < 1e-4 and (s_b - s_all).abs().max() < 1e-4


def test_key_heads_are_tiled_across_value_heads():
    # value head h must read key head h % Hk: compare against an explicit per-head loop
    q, k, v, g, beta, s0 = _inputs(9, 2, 6, 16, seed=11, dtype=torch.float64)
    o, _ = gdn_recurrent(q, k, v, g, beta, s0, scale=0.25)
    for h in range(6):
        s = s0[h].clone()
        for t in range(9):
            s = s * torch.exp(g[t, h])
            kk, qq = k[t, h % 2], q[t, h % 2]
            s = s + torch.outer(kk, beta[t, h] * (v[t, h] - s.T @ kk))
            assert torch.allclose(o[t, h], 0.25 * s.T @ qq, atol=1e-12)


def test_causal_conv_matches_conv1d_and_carries_state():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 24, generator=gen)
    w = torch.randn(24, 4, generator=gen)
    ref = F.conv1d(F.pad(x.T[None], (3, 0)), w[:, None, :], groups=24)[0].T
    y, st = causal_conv(x, torch.zeros(3, 24), w)
    y1, st1 = causal_conv(x[:25], torch.zeros(3, 24), w)
    ys = [y1]
    for t in range(25, 40):                     # decode one token at a time
        yt, st1 = causal_conv(x[t:t + 1], st1, w)
        ys.append(yt)
    err = (y - ref).abs().max().item()
    err_split = (torch.cat(ys) - ref).abs().max().item()
    print(f"causal conv vs F.conv1d: {err:.2e}, token-by-token: {err_split:.2e}")
    assert err < 1e-5 and err_split < 1e-5
    assert torch.equal(st, x[-3:]) and torch.equal(st1, x[-3:])


@pytest.mark.parametrize("t,hk,hv", [(1, 2, 4), (3, 2, 2)])
def test_recurrent_op_for_compiled_forwards(t, hk, hv):
    """Under torch.compile the recurrence is the opaque op kvcompile::gdn_recurrent: its
    schema, fake (shapes and dtypes) and aliasing hold (opcheck), it equals the eager
    call bitwise, and a compiled function that calls gdn_recurrent records the op."""
    q, k, v, g, beta, s0 = _inputs(t, hk, hv, 16, seed=t + 31 * hv)
    scale = 0.25
    torch.library.opcheck(torch.ops.kvcompile.gdn_recurrent.default,
                          (q, k, v, g, beta, s0, scale))
    o, s = torch.ops.kvcompile.gdn_recurrent(q, k, v, g, beta, s0, scale)
    o_ref, s_ref = gdn_recurrent(q, k, v, g, beta, s0, scale)
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda *a: gdn_recurrent(*a, scale), backend=backend, fullgraph=True)
    o_c, s_c = fn(q, k, v, g, beta, s0)
    assert any("gdn_recurrent" in n for n in seen), seen
    assert torch.equal(o_c, o_ref) and torch.equal(s_c, s_ref)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", [pytest.param(d, marks=pytest.mark.gpu) if d == "cuda"
                                    else d for d in DEVICES])
@pytest.mark.parametrize("t,hk,hv", [(6, 2, 4), (49, 2, 6)])
def test_recurrent_rows_in_one_call_equal_one_row_calls(device, t, hk, hv):
    """A verify forward runs its rows through gdn_recurrent in one call and a rollback
    reruns kept rows in one call with every layer's heads side by side; decode runs one row
    a call. Speculation is exact only if these agree bit for bit: every row's output, and
    the state after any number of rows, whatever the head count (fla's fused recurrence is
    one compiled kernel for every row count)."""
    q, k, v, g, beta, s0 = (x.to(device) for x in _inputs(t, hk, hv, 32, seed=7 * t + hv))
    scale = 1 / math.sqrt(32)
    o_all, s_all = gdn_recurrent(q, k, v, g, beta, s0, scale)
    s, outs, states = s0, [], []
    for r in range(t):
        o_r, s = gdn_recurrent(q[r:r + 1], k[r:r + 1], v[r:r + 1], g[r:r + 1],
                               beta[r:r + 1], s, scale)
        outs.append(o_r)
        states.append(s)
    assert torch.equal(o_all, torch.cat(outs)) and torch.equal(s_all, states[-1])
    # two "layers" folded into one call's heads, the first `keep` rows: each layer's state
    # (key heads expanded to the value heads first, as the recorded rows are)
    keep = t // 2 + 1
    fold = lambda x: torch.cat([x, x.flip(0)], 1)[:keep]   # noqa: E731
    q2, k2 = (fold(expand_key_heads(x, hv)) for x in (q, k))
    _, s_fold = gdn_recurrent(q2, k2, fold(v), fold(g), fold(beta),
                              torch.cat([s0, s0.flip(0)]), scale)
    assert torch.equal(s_fold[:hv], states[keep - 1])
