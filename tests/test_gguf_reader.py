"""GGUF reading against independent oracles: llama.cpp's own model loader (geometry,
metadata, parameter counts, rope type) and the gguf package's dequantization."""
from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch

from kvcompile.io.gguf.arch_config import config_from_metadata
from kvcompile.io.gguf.reader import open_gguf
from kvcompile.io.model_info import format_model_info, model_info
from kvcompile.ops.kv_format import KV_TYPES
from kvcompile.io.weights import load_weights


@pytest.fixture(scope="module")
def llama_cpp_model(smollm2_path):
    """llama.cpp's view of the file: loaded with its C API, tensors on the CPU."""
    import llama_cpp
    llama_cpp.llama_backend_init()
    import llama_cpp._logger
    llama_cpp._logger.set_verbose(False)  # the C loader logs every tensor otherwise
    params = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(smollm2_path).encode(), params)
    assert model, "llama.cpp could not load the SmolLM2 GGUF"
    yield model
    llama_cpp.llama_model_free(model)


def _llama_cpp_meta(model) -> dict[str, str]:
    import llama_cpp
    out = {}
    buf = ctypes.create_string_buffer(1 << 16)
    for i in range(llama_cpp.llama_model_meta_count(model)):
        llama_cpp.llama_model_meta_key_by_index(model, i, buf, len(buf))
        key = buf.value.decode()
        llama_cpp.llama_model_meta_val_str_by_index(model, i, buf, len(buf))
        out[key] = buf.value.decode()
    return out


def test_config_matches_llama_cpp(smollm2_path, llama_cpp_model):
    import llama_cpp
    f = open_gguf(smollm2_path)
    cfg = config_from_metadata(f.metadata, f.tensors)
    m = llama_cpp_model
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(m))
    ref = dict(n_layers=llama_cpp.llama_model_n_layer(m), hidden=llama_cpp.llama_model_n_embd(m),
               n_heads=llama_cpp.llama_model_n_head(m), n_kv_heads=llama_cpp.llama_model_n_head_kv(m),
               context_length=llama_cpp.llama_model_n_ctx_train(m), vocab_size=vocab)
    ours = {k: getattr(cfg, k) for k in ref}
    print("kvcompile:", ours, "\nllama.cpp:", ref)
    assert ours == ref
    # llama.cpp's rope type for this arch: NORM (0) = adjacent pairs, NEOX (2) = halves
    rope_type = llama_cpp.llama_model_rope_type(m)
    print("llama.cpp rope type", rope_type, "kvcompile rope_neox", cfg.rope_neox)
    assert cfg.rope_neox == (rope_type == llama_cpp.LLAMA_ROPE_TYPE_NEOX)
    assert cfg.arch == "llama" and cfg.head_dim == 64 and cfg.ffn == 1536
    assert cfg.tie_embeddings and "output.weight" not in f.tensors


def test_metadata_matches_llama_cpp(smollm2_path, llama_cpp_model):
    f = open_gguf(smollm2_path)
    ref = _llama_cpp_meta(llama_cpp_model)
    checked = 0
    for key, text in ref.items():
        ours = f.metadata.get(key)
        assert key in f.metadata, key
        if isinstance(ours, bool):
            assert str(ours).lower() == text, key
        elif isinstance(ours, (int, float)):
            assert float(text) == pytest.approx(float(ours), rel=1e-6), key
        elif isinstance(ours, str) and len(ours) < 60000:
            assert ours == text, key
        else:
            continue
        checked += 1
    print(f"{checked} scalar metadata values equal llama.cpp's; "
          f"{len(f.metadata['tokenizer.ggml.tokens'])} tokens, "
          f"{len(f.metadata['tokenizer.ggml.merges'])} merges")
    assert checked >= 20
    assert isinstance(f.metadata["tokenizer.ggml.tokens"][100], str)
    assert all(type(v) is int for v in f.metadata["tokenizer.ggml.token_type"][:100])


def test_tensor_infos_and_dequant(smollm2_path):
    f = open_gguf(smollm2_path)
    raw = gguf.GGUFReader(str(smollm2_path))
    assert len(f.tensors) == len(raw.tensors) == 272
    rng = np.random.default_rng()
    picks = [raw.tensors[i] for i in rng.choice(len(raw.tensors), 12, replace=False)]
    picks.append(next(t for t in raw.tensors if t.name == "token_embd.weight"))
    for t in picks:
        info = f.tensors[t.name]
        assert info.ggml_type == t.tensor_type.name
        assert info.shape == tuple(int(d) for d in t.shape[::-1])  # ggml ne0 is the row length
        ref = gguf.quants.dequantize(np.array(t.data), t.tensor_type).reshape(info.shape)
        got = f.tensor(t.name)
        assert got.dtype == torch.float32 and tuple(got.shape) == info.shape
        assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32)))
    q = f.tensors["blk.0.attn_q.weight"]
    print("attn_q", q.ggml_type, q.shape, "token_embd", f.tensors["token_embd.weight"].shape)
    assert q.shape == (576, 576) and f.tensors["blk.0.attn_k.weight"].shape == (192, 576)
    assert f.tensors["blk.0.ffn_down.weight"].shape == (576, 1536)


def test_load_weights(smollm2_path, capsys):
    w = load_weights(smollm2_path, dtype=torch.bfloat16, progress=False)
    assert capsys.readouterr().err == ""  # progress=False prints nothing
    assert w.source == "gguf" and w.config.n_layers == 30
    names = {f"blk.{i}.{n}.weight" for i in range(30) for n in (
        "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
        "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")} | {"token_embd.weight", "output_norm.weight"}
    assert set(w.tensors) == names
    # matrices in the asked dtype; vectors (norms) stay fp32, as the models apply them
    assert all(t.dtype == (torch.float32 if t.dim() == 1 else torch.bfloat16)
               for t in w.tensors.values())
    load_weights(smollm2_path, progress=True)
    err = capsys.readouterr().err
    print("progress bar tail:", err.strip().splitlines()[-1][-80:] if err.strip() else err)
    assert "loading SmolLM2" in err and "MB/" in err        # a bar in bytes


def test_f32_export_is_exact(smollm2_path, smollm2_f32_path):
    src, dst = open_gguf(smollm2_path), open_gguf(smollm2_f32_path)
    assert set(dst.tensors) == set(src.tensors)
    assert {t.ggml_type for t in dst.tensors.values()} == {"F32"}
    assert dst.metadata["general.file_type"] == 0
    skip = {"general.file_type", "general.quantization_version"}
    assert {k: v for k, v in dst.metadata.items() if k not in skip} == \
           {k: v for k, v in src.metadata.items() if k not in skip}
    for name in ("token_embd.weight", "blk.7.attn_k.weight", "blk.29.ffn_down.weight"):
        assert torch.equal(dst.tensor(name), src.tensor(name)), name
    print("F32 export:", smollm2_f32_path.stat().st_size, "bytes")


def test_model_info_matches_llama_cpp(smollm2_path, llama_cpp_model):
    import llama_cpp
    info = model_info(smollm2_path)
    text = format_model_info(info)
    print(text)
    n_params = llama_cpp.llama_model_n_params(llama_cpp_model)
    size = llama_cpp.llama_model_size(llama_cpp_model)
    print("llama.cpp params", n_params, "bytes", size)
    assert info["params"] == n_params and info["param_bytes"] == size
    assert info["quant_types"]["Q4_1"]["tensors"] == 210
    assert info["quant_types"]["Q8_0"]["tensors"] == 1
    # K + V for 30 layers x 3 KV heads x 64 dims, per ggml block sizes (32 values per block)
    per_block = {"f32": 128, "f16": 64, "bf16": 64, "q8_0": 34, "q4_0": 18}
    for name in KV_TYPES:
        assert info["kv_bytes_per_token"][name] == 2 * 30 * 3 * 64 // 32 * per_block[name]
    for needle in ("llama", "Q4_1", "q8_0", "head dim 64", "49152"):
        assert needle in text
