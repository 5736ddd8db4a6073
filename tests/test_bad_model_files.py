"""Bad model files fail with a KvcompileError subclass whose message says what to change."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from kvcompile.errors import ModelFileError, UnsupportedModelError
from kvcompile.io.gguf.reader import open_gguf
from kvcompile.io.model_info import model_info
from kvcompile.io.weights import load_weights

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 128, 4, 2, 1, 96


def llama_metadata(arch: str = "llama") -> dict:
    return {
        f"{arch}.block_count": LAYERS, f"{arch}.context_length": 256,
        f"{arch}.embedding_length": HIDDEN, f"{arch}.feed_forward_length": FFN,
        f"{arch}.attention.head_count": HEADS, f"{arch}.attention.head_count_kv": KV_HEADS,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5, f"{arch}.rope.freq_base": 10000.0,
    }


def write_tiny_gguf(path, arch="llama", drop_key=None, odd_tensor=None):
    """A one-layer llama-shaped GGUF with random F32 weights. odd_tensor=(name, qtype)
    adds one tensor of that ggml type with random bytes."""
    rng = np.random.default_rng()
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in llama_metadata(arch).items():
        if key == drop_key:
            continue
        if isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    hd = HIDDEN // HEADS
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
              "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
              "blk.0.attn_k.weight": (KV_HEADS * hd, HIDDEN),
              "blk.0.attn_v.weight": (KV_HEADS * hd, HIDDEN),
              "blk.0.attn_output.weight": (HIDDEN, HIDDEN), "blk.0.ffn_norm.weight": (HIDDEN,),
              "blk.0.ffn_gate.weight": (FFN, HIDDEN), "blk.0.ffn_up.weight": (FFN, HIDDEN),
              "blk.0.ffn_down.weight": (HIDDEN, FFN)}
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    if odd_tensor is not None:
        name, qtype = odd_tensor
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (8, HIDDEN // block * type_size), dtype=np.uint8)
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _raises(exc_type, fn, *words):
    with pytest.raises(exc_type) as info:
        fn()
    msg = str(info.value)
    print(f"{exc_type.__name__}: {msg}")
    for word in words:
        assert word in msg, (word, msg)
    return msg


def test_tiny_gguf_loads(tmp_path):
    """The writer used below makes valid files: the unmodified one loads."""
    w = load_weights(write_tiny_gguf(tmp_path / "tiny.gguf"), progress=False)
    assert w.config.hidden == HIDDEN and w.config.vocab_size == VOCAB and w.config.tie_embeddings
    assert tuple(w.tensors["blk.0.attn_k.weight"].shape) == (KV_HEADS * HIDDEN // HEADS, HIDDEN)


def test_truncated_gguf(smollm2_path, tmp_path):
    size = smollm2_path.stat().st_size
    cut = int(np.random.default_rng().integers(size // 4, size - 1024))
    bad = tmp_path / "truncated.gguf"
    with open(smollm2_path, "rb") as src, open(bad, "wb") as dst:
        dst.write(src.read(cut))
    print("cut at", cut, "of", size)
    _raises(ModelFileError, lambda: open_gguf(bad), "truncated", "re-download")
    _raises(ModelFileError, lambda: load_weights(bad, progress=False), "truncated")
    # cut inside the metadata (the token list) rather than the tensor data
    with open(smollm2_path, "rb") as src, open(bad, "wb") as dst:
        dst.write(src.read(int(np.random.default_rng().integers(64, 500_000))))
    _raises(ModelFileError, lambda: model_info(bad), "truncated or corrupt", "re-download")


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(np.random.default_rng().integers(0, 256, 4096, dtype=np.uint8).tobytes())
    _raises(ModelFileError, lambda: load_weights(bad, progress=False), "not a GGUF file")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _raises(ModelFileError, lambda: open_gguf(empty), "not a GGUF file")
    _raises(ModelFileError, lambda: load_weights(tmp_path / "missing.gguf"), "does not exist")


def test_unsupported_architecture(tmp_path):
    path = write_tiny_gguf(tmp_path / "odd.gguf", arch="mamba")
    msg = _raises(UnsupportedModelError, lambda: load_weights(path, progress=False),
                  "'mamba'", "llama")
    assert "supported" in msg
    _raises(UnsupportedModelError, lambda: model_info(path), "'mamba'")


def test_unsupported_tensor_type(tmp_path):
    # Q8_1 is a ggml type the gguf package knows but cannot dequantize
    path = write_tiny_gguf(tmp_path / "q81.gguf",
                           odd_tensor=("blk.0.odd.weight", gguf.GGMLQuantizationType.Q8_1))
    _raises(UnsupportedModelError, lambda: load_weights(path, progress=False),
            "'blk.0.odd.weight'", "Q8_1", "re-quantize")
    # a type id no ggml version has: patch the stored id of the odd tensor
    data = bytearray(path.read_bytes())
    name = b"blk.0.odd.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8  # n_dims (u32), 2 dims (u64), then type
    assert int.from_bytes(data[at:at + 4], "little") == gguf.GGMLQuantizationType.Q8_1
    data[at:at + 4] = (201).to_bytes(4, "little")
    patched = tmp_path / "patched.gguf"
    patched.write_bytes(bytes(data))
    _raises(UnsupportedModelError, lambda: open_gguf(patched), "'blk.0.odd.weight'", "201")


def test_missing_metadata_key(tmp_path):
    path = write_tiny_gguf(tmp_path / "nokey.gguf", drop_key="llama.block_count")
    _raises(ModelFileError, lambda: load_weights(path, progress=False),
            "'llama.block_count'", "re-convert")

