"""The NextN/MTP layer of a qwen35 GGUF: kvcompile's forward (paged KV, two calls) equals an
fp64 dense reference written here from the format, reading the file with the gguf package."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvcompile.kv.store import KvStore
from kvcompile.errors import UnsupportedModelError
from kvcompile.io.gguf.synthetic import preset_config, write_synthetic_gguf
from kvcompile.models.qwen35 import Qwen35Model
from kvcompile.io.weights import load_weights


@pytest.fixture(scope="module")
def mtp_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtp") / "qwen35-mtp.gguf"
    # 12 layers so that the MTP block sits at index 12, not next to an attention layer
    cfg = preset_config("qwen35", "tiny", n_layers=12, vocab_size=2048, n_heads=8)
    write_synthetic_gguf(cfg, path, "f32", seed=99)
    return path


def _read(path):
    r = gguf.GGUFReader(str(path))
    md = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.")}
    w = {t.name: torch.from_numpy(np.array(t.data, dtype=np.float64)).reshape(
        tuple(reversed(t.shape.tolist()))) for t in r.tensors}
    return md, w


def _rms(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_neox(x, pos, rot, theta):
    inv = theta ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = pos.double()[:, None, None] * inv
    a, b = x[..., : rot // 2], x[..., rot // 2: rot]
    return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin(),
                      x[..., rot:]], dim=-1)


def mtp_reference(md, w, tokens, hidden, positions):
    """Dense fp64 MTP: block(eh_proj([enorm(embed tok), hnorm(h)])) -> shared head norm ->
    output; the block is a qwen35 full-attention block (gated q, q/k norm, NEOX rope)."""
    a = "qwen35"
    n_main = md[f"{a}.block_count"] - md[f"{a}.nextn_predict_layers"]
    p, eps = f"blk.{n_main}.", md[f"{a}.attention.layer_norm_rms_epsilon"]
    nh, nkv = md[f"{a}.attention.head_count"], md[f"{a}.attention.head_count_kv"]
    hd, rot = md[f"{a}.attention.key_length"], md[f"{a}.rope.dimension_count"]
    t = tokens.shape[0]
    e = _rms(w["token_embd.weight"][tokens], w[p + "nextn.enorm.weight"], eps)
    h = _rms(hidden.double(), w[p + "nextn.hnorm.weight"], eps)
    x = torch.cat([e, h], -1) @ w[p + "nextn.eh_proj.weight"].T
    y = _rms(x, w[p + "attn_norm.weight"], eps)
    qg = (y @ w[p + "attn_q.weight"].T).view(t, nh, 2 * hd)
    q, gate = _rms(qg[..., :hd], w[p + "attn_q_norm.weight"], eps), qg[..., hd:]
    k = _rms((y @ w[p + "attn_k.weight"].T).view(t, nkv, hd), w[p + "attn_k_norm.weight"], eps)
    v = (y @ w[p + "attn_v.weight"].T).view(t, nkv, hd)
    theta = md[f"{a}.rope.freq_base"]
    q, k = _rope_neox(q, positions, rot, theta), _rope_neox(k, positions, rot, theta)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5
    visible = positions[None, :] <= positions[:, None]
    att = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    o = torch.einsum("hqk,khd->qhd", att, v) * torch.sigmoid(gate)
    x = x + o.reshape(t, nh * hd) @ w[p + "attn_output.weight"].T
    y = _rms(x, w[p + "post_attention_norm.weight"], eps)
    ff = F.silu(y @ w[p + "ffn_gate.weight"].T) * (y @ w[p + "ffn_up.weight"].T)
    x = x + ff @ w[p + "ffn_down.weight"].T
    out = _rms(x, w[p + "nextn.shared_head_norm.weight"], eps)
    return out @ w["output.weight"].T


def test_mtp_forward_matches_fp64_reference(mtp_file):
    loaded = load_weights(mtp_file, progress=False)
    model = Qwen35Model.from_weights(loaded.config, loaded.tensors)
    cache = KvStore.for_model(model, 256)
    gen = torch.Generator().manual_seed(5)
    n = 48
    tokens = torch.randint(300, loaded.config.vocab_size, (n + 1,), generator=gen)
    with torch.no_grad():
        _, hidden = model(tokens[:n], torch.arange(n), cache, return_hidden=True)
        # MTP row p: main hidden at p with the next token; 40 rows at once, then 8 single
        pos = torch.arange(n)
        rows = [model.mtp_forward(tokens[1:41], hidden[:40], pos[:40], cache)]
        for i in range(40, n):
            rows.append(model.mtp_forward(tokens[i + 1:i + 2], hidden[i:i + 1], pos[i:i + 1], cache))
    ours = torch.cat(rows).double()
    md, w = _read(mtp_file)
    ref = mtp_reference(md, w, tokens[1:], hidden.double(), pos)
    err = (ours - ref).abs().max().item()
    top1 = (ours.argmax(-1) == ref.argmax(-1)).double().mean().item()
    lp = torch.log_softmax(ref, -1)
    entropy = -(lp.exp() * lp).sum(-1)
    print(f"\nMTP vs fp64 reference: max |dlogit| {err:.2e} (|logit| max "
          f"{ref.abs().max().item():.2f}), top-1 {top1:.3f}, entropy median "
          f"{entropy.median().item():.2f} of {np.log(ref.shape[1]):.2f}")
    assert err < 2e-4 * ref.abs().max().item() and top1 == 1.0
    # the MTP output depends on the hidden input: zeroing half of it changes the logits
    with torch.no_grad():
        cache2 = KvStore.for_model(model, 256)
        alt = model.mtp_forward(tokens[1:41], hidden[:40] * 0.5 + 1.0, pos[:40], cache2)
    assert (alt.double() - ref[:40]).abs().max() > 0.1


def llama_cpp_mtp_logits(path, tokens, hidden, positions):
    """Logits of llama.cpp's own MTP graph (an LLAMA_CONTEXT_TYPE_MTP context): each batch
    row carries a token id and, through the batch's embd pointer, the hidden-state input."""
    import ctypes

    import llama_cpp as L
    n, n_embd = hidden.shape
    mp = L.llama_model_default_params()
    mp.load_mtp = True
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 256
    cp.n_threads = cp.n_threads_batch = 2
    cp.type_k = cp.type_v = 0          # F32 KV
    cp.flash_attn_type = 0             # the F16 flash-attention path would round Q
    cp.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
    ctx = L.llama_init_from_model(model, cp)
    try:
        h = np.ascontiguousarray(hidden.numpy(), dtype=np.float32)
        seq0 = (L.llama_seq_id * 1)(0)
        arrays = dict(
            token=(L.llama_token * n)(*tokens.tolist()), pos=(L.llama_pos * n)(*positions.tolist()),
            n_seq_id=(ctypes.c_int32 * n)(*[1] * n), logits=(ctypes.c_int8 * n)(*[1] * n),
            seq_id=(ctypes.POINTER(L.llama_seq_id) * n)(*[ctypes.cast(seq0, ctypes.POINTER(L.llama_seq_id))] * n))
        batch = L.llama_batch(n_tokens=n, embd=h.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                              **arrays)
        assert L.llama_decode(ctx, batch) == 0
        vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        rows = [np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(vocab,)).copy()
                for i in range(n)]
        return torch.from_numpy(np.stack(rows))
    finally:
        L.llama_free(ctx)
        L.llama_model_free(model)


def test_mtp_forward_matches_llama_cpp_mtp_graph(mtp_file):
    loaded = load_weights(mtp_file, progress=False)
    model = Qwen35Model.from_weights(loaded.config, loaded.tensors)
    cache = KvStore.for_model(model, 256)
    n = 40
    tokens = torch.randint(300, loaded.config.vocab_size, (n + 1,),
                           generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        _, hidden = model(tokens[:n], torch.arange(n), cache, return_hidden=True)
        ours = model.mtp_forward(tokens[1:], hidden, torch.arange(n), cache)
    ref = llama_cpp_mtp_logits(mtp_file, tokens[1:], hidden, torch.arange(n))
    err = (ours - ref).abs().max().item()
    top1 = (ours.argmax(-1) == ref.argmax(-1)).double().mean().item()
    print(f"\nMTP vs llama.cpp MTP context: max |dlogit| {err:.2e} (|logit| max "
          f"{ref.abs().max().item():.2f}), top-1 {top1:.3f}")
    assert top1 == 1.0 and err < 1e-4 * ref.abs().max().item()


def test_mtp_needs_an_mtp_layer(tmp_path):
    path = tmp_path / "no-mtp.gguf"
    write_synthetic_gguf(preset_config("qwen35", "tiny", nextn_layers=0, vocab_size=512,
                                       n_layers=4), path, "f32", seed=1)
    loaded = load_weights(path, progress=False)
    model = Qwen35Model.from_weights(loaded.config, loaded.tensors)
    cache = KvStore.for_model(model, 16)
    with torch.no_grad():
        _, hidden = model(torch.tensor([400, 401]), torch.arange(2), cache, return_hidden=True)
        with pytest.raises(UnsupportedModelError, match="no NextN/MTP layer") as err:
            model.mtp_forward(torch.tensor([402]), hidden[-1:], torch.tensor([1]), cache)
    print(err.value)
