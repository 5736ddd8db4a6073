"""Hugging Face llama checkpoints: a 4-layer SmolLM2 written both as HF (config.json +
safetensors, q/k rows in HF's NEOX order) and as an F32 GGUF (llama.cpp's adjacent-pair
order). kvcompile on the HF folder must match llama.cpp on the GGUF."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from kvcompile.errors import ModelFileError, UnsupportedModelError
from kvcompile.io.hf_checkpoint import _LAYER_NAMES, _TOP_NAMES
from kvcompile.kv.store import KvStore
from kvcompile.io.model_info import format_model_info, model_info
from kvcompile.models.llama import LlamaModel
from kvcompile.io.weights import load_weights
from llama_oracle import agreement, llama_cpp, llama_cpp_logits

N_LAYERS = 4
N_TOKENS = 64


def gguf_rows_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert permutation: within each head, GGUF row 2p + s holds what
    HF stores at row s * d/2 + p (rotation pair p, member s)."""
    rows, cols = w.shape
    d = rows // n_heads
    return w.reshape(n_heads, d // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


@pytest.fixture(scope="module")
def small_model(smollm2_path, tmp_path_factory):
    """(GGUF path, HF folder, GGUF-named F32 tensors) for SmolLM2's first N_LAYERS layers."""
    src = gguf.GGUFReader(str(smollm2_path))
    w = load_weights(smollm2_path, progress=False)
    keep = {n: t for n, t in w.tensors.items()
            if not n.startswith("blk.") or int(n.split(".")[1]) < N_LAYERS}
    folder = tmp_path_factory.mktemp("small_smollm2")

    gguf_path = folder / "small.gguf"
    writer = gguf.GGUFWriter(str(gguf_path), "llama")
    for key, f in src.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        value = N_LAYERS if key == "llama.block_count" else f.contents()
        writer.add_key_value(key, value, f.types[0], sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for name, t in keep.items():
        writer.add_tensor(name, t.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    c = w.config
    hf_dir = folder / "hf"
    hf_dir.mkdir()
    to_hf = {v: k for k, v in _TOP_NAMES.items()}
    to_hf_layer = {v: k for k, v in _LAYER_NAMES.items()}
    hf = {}
    for name, t in keep.items():
        if name.startswith("blk."):
            _, i, rest = name.split(".", 2)
            key = f"model.layers.{i}.{to_hf_layer[rest]}"
        else:
            key = to_hf[name]
        if name.endswith("attn_q.weight"):
            t = gguf_rows_to_hf(t, c.n_heads)
        elif name.endswith("attn_k.weight"):
            t = gguf_rows_to_hf(t, c.n_kv_heads)
        hf[key] = t.contiguous()
    half = len(hf) // 2  # two shards, as large checkpoints come
    items = sorted(hf.items())
    save_file(dict(items[:half]), str(hf_dir / "model-00001-of-00002.safetensors"))
    save_file(dict(items[half:]), str(hf_dir / "model-00002-of-00002.safetensors"))
    (hf_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": c.hidden, "intermediate_size": c.ffn, "num_hidden_layers": N_LAYERS,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
        "vocab_size": c.vocab_size, "max_position_embeddings": c.context_length,
        "rms_norm_eps": c.rms_eps, "rope_theta": c.rope_theta, "rope_scaling": None,
        "tie_word_embeddings": True, "torch_dtype": "float32"}))
    return gguf_path, hf_dir, keep


def test_hf_config_and_qk_permutation(small_model):
    gguf_path, hf_dir, ref = small_model
    hf = load_weights(hf_dir, progress=False)
    gg = load_weights(gguf_path, progress=False)
    assert hf.source == "hf" and gg.source == "gguf"
    print("HF config:  ", hf.config)
    print("GGUF config:", gg.config)
    fields = ("n_layers", "hidden", "ffn", "n_heads", "n_kv_heads", "head_dim", "vocab_size",
              "context_length", "rope_theta", "rotary_dim", "tie_embeddings")
    assert {f: getattr(hf.config, f) for f in fields} == {f: getattr(gg.config, f) for f in fields}
    assert hf.config.rms_eps == pytest.approx(gg.config.rms_eps)
    assert hf.config.rope_neox and not gg.config.rope_neox
    assert set(hf.tensors) == set(ref)
    c = hf.config
    for i in range(N_LAYERS):
        q, k = hf.tensors[f"blk.{i}.attn_q.weight"], hf.tensors[f"blk.{i}.attn_k.weight"]
        # the HF rows are a permutation of the GGUF rows, not equal to them
        assert not torch.equal(q, ref[f"blk.{i}.attn_q.weight"])
        assert torch.equal(q, gguf_rows_to_hf(ref[f"blk.{i}.attn_q.weight"], c.n_heads))
        assert torch.equal(k, gguf_rows_to_hf(ref[f"blk.{i}.attn_k.weight"], c.n_kv_heads))
    for name in ("token_embd.weight", "blk.2.ffn_down.weight", "blk.3.attn_v.weight"):
        assert torch.equal(hf.tensors[name], ref[name])


def test_hf_model_info(small_model):
    gguf_path, hf_dir, ref = small_model
    hf, gg = model_info(hf_dir), model_info(gguf_path)
    print(format_model_info(hf))
    assert hf["params"] == gg["params"] == sum(t.numel() for t in ref.values())
    assert hf["quant_types"] == gg["quant_types"]  # all float32 in both
    for key in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab",
                "kv_bytes_per_token", "tie_embeddings"):
        assert hf[key] == gg[key], key
    assert hf["rope"]["layout"] == "neox" and gg["rope"]["layout"] == "adjacent pairs"


def test_hf_logits_match_llama_cpp(small_model, smollm2_path):
    from llama_cpp import Llama
    gguf_path, hf_dir, _ = small_model
    vocab = Llama(str(smollm2_path), vocab_only=True, verbose=False)
    text = ("Rivers carve valleys slowly; glaciers do it faster, grinding rock into flour that "
            "turns meltwater lakes a milky turquoise. Geologists read these landscapes like "
            "pages, counting layers of sediment to date floods that happened long before any "
            "human watched them, and they argue about how quickly the ice retreated.")
    ids = vocab.tokenize(text.encode(), add_bos=False)
    start = int(np.random.default_rng().integers(0, max(1, len(ids) - N_TOKENS + 1)))
    tokens = ids[start:start + N_TOKENS]
    logits = {}
    for label, path in (("hf", hf_dir), ("gguf", gguf_path)):
        w = load_weights(path, progress=False)
        model = LlamaModel.from_weights(w.config, w.tensors, dtype=torch.float32, device="cpu")
        cache = KvStore(w.config, max_tokens=len(tokens))
        with torch.no_grad():
            logits[label] = model(torch.tensor(tokens), torch.arange(len(tokens)), cache)
    ref = llama_cpp_logits(llama_cpp(gguf_path, n_ctx=2 * N_TOKENS), tokens)
    for label, ours in logits.items():
        top1, kl, kl_max = agreement(ours, ref)
        print(f"kvcompile on {label} vs llama.cpp on the F32 GGUF, {len(tokens)} tokens: "
              f"top1 {top1:.1%}, KL mean {kl:.2e}, max {kl_max:.2e}")
        assert top1 >= 0.98 and kl <= 1e-4, label
    diff = (logits["hf"] - logits["gguf"]).abs().max().item()
    print("max |HF - GGUF| logit difference in kvcompile:", diff)
    assert diff < 1e-3


def test_bad_hf_checkpoints(tmp_path, small_model):
    _, hf_dir, _ = small_model
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelFileError, match="no config.json") as e:
        load_weights(empty, progress=False)
    print(e.value)
    cfg = json.loads((hf_dir / "config.json").read_text())
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({**cfg, "model_type": "falcon"}))
    with pytest.raises(UnsupportedModelError, match="'falcon'") as e:
        load_weights(odd, progress=False)
    print(e.value)
    (odd / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match="no \\*.safetensors") as e:
        load_weights(odd / "config.json", progress=False)
    print(e.value)
    shard = sorted(hf_dir.glob("*.safetensors"))[0].read_bytes()
    (odd / "model.safetensors").write_bytes(shard[: len(shard) // 2])
    with pytest.raises(ModelFileError, match="re-download") as e:
        load_weights(odd, progress=False)
    print(e.value)
