"""Crafted GGUF headers fail fast with a clear error, never exhaust memory (issue 30).

Each case is a few dozen bytes built here with struct. One worker process (this file run
as a script) parses them all, so that its peak RSS measures the parser alone; the issue's
file once grew to 7.3 GB in 60 s. Also: an unsupported architecture with a 262K vocabulary
is refused before the vocabulary is decoded, and big vocabularies parse fast.
"""
from __future__ import annotations

import json
import struct
import subprocess
import sys
import time

import pytest

from kvcompile.errors import ModelFileError, UnsupportedModelError
from kvcompile.io.gguf.header import read_header

U8, U32, F32_V, STR, ARR, U64 = 0, 4, 6, 8, 9, 10   # GGUF value types
F32, Q4_0 = 0, 2                                      # ggml types


def s(text: str | bytes) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def head(n_tensors: int, n_kv: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


ARCH = kv("general.architecture", STR, s("llama"))


def tensor(name: str, dims, ggml_type: int = F32, offset: int = 0, n_dims: int | None = None):
    n = len(dims) if n_dims is None else n_dims
    return (s(name) + struct.pack("<I", n) + struct.pack(f"<{len(dims)}Q", *dims)
            + struct.pack("<IQ", ggml_type, offset))


def with_data(header: bytes, n_bytes: int = 64) -> bytes:
    """The header padded to 32 bytes, then n_bytes of tensor data."""
    return header + b"\0" * (-len(header) % 32) + b"\1" * n_bytes


def one_tensor(dims, ggml_type=F32, offset=0, n_dims=None, n_bytes=64) -> bytes:
    return with_data(head(1, 1) + ARCH + tensor("w", dims, ggml_type, offset, n_dims), n_bytes)


VALID_HEADER = (head(2, 2) + ARCH + kv("general.alignment", U32, struct.pack("<I", 32))
                + tensor("a", (8, 2)) + tensor("b", (4,), offset=64))
VALID = with_data(VALID_HEADER, 96)

# name -> (file bytes, error class, words the message must hold besides the file's name)
CASES = {
    # the file: `general.architecture` declared as an array of 2^40 uint8
    "issue": (head(0, 1) + kv("general.architecture", ARR, struct.pack("<IQ", U8, 1 << 40)),
              ModelFileError, ["'general.architecture'", "1099511627776"]),
    "kv_count": (head(0, 1000) + ARCH, ModelFileError, ["key/value count 1000"]),
    "kv_count_huge": (head(0, 1 << 62) + ARCH, ModelFileError, ["key/value count"]),
    "tensor_count": (head(1000, 1) + ARCH, ModelFileError, ["tensor count 1000"]),
    "tensor_count_huge": (head(1 << 40, 1) + ARCH, ModelFileError, ["tensor count"]),
    "key_length": (head(0, 1) + struct.pack("<Q", 1 << 50) + b"general", ModelFileError,
                   ["name of key/value 0"]),
    "string_length": (head(0, 2) + ARCH + kv("general.name", STR, struct.pack("<Q", 1 << 40)),
                      ModelFileError, ["'general.name'"]),
    "string_past_end": (head(0, 2) + ARCH + kv("general.name", STR, struct.pack("<Q", 999) + b"x"),
                        ModelFileError, ["'general.name'", "999 bytes"]),
    "array_length": (head(0, 2) + ARCH
                     + kv("tokenizer.ggml.tokens", ARR, struct.pack("<IQ", STR, 1 << 20) + s("a")),
                     ModelFileError, ["'tokenizer.ggml.tokens'", "1048576"]),
    "array_length_huge": (head(0, 2) + ARCH
                          + kv("tokenizer.ggml.scores", ARR, struct.pack("<IQ", F32_V, 1 << 62)),
                          ModelFileError, ["'tokenizer.ggml.scores'"]),
    "array_element_length": (head(0, 2) + ARCH + kv("tokenizer.ggml.tokens", ARR, struct.pack(
        "<IQ", STR, 2) + s("a") + struct.pack("<Q", 1 << 40)), ModelFileError,
        ["element 1", "'tokenizer.ggml.tokens'"]),
    "array_element_type": (head(0, 2) + ARCH + kv("x", ARR, struct.pack("<IQ", 99, 1) + b"\0" * 8),
                           ModelFileError, ["element type", "'x'", "99"]),
    "nested_array": (head(0, 2) + ARCH + kv("x", ARR, struct.pack("<IQIQ", ARR, 1, U8, 1) + b"\0"),
                     ModelFileError, ["'x'", "array of arrays"]),
    "value_type": (head(0, 2) + ARCH + kv("x", 42, b"\0" * 8), ModelFileError,
                   ["value type of key 'x'", "42"]),
    "bad_utf8_key": (head(0, 2) + ARCH + kv(b"\xff\xfe", U8, b"\0"), ModelFileError,
                     ["name of key/value 1", "UTF-8"]),
    "duplicate_key": (head(0, 2) + ARCH + ARCH, ModelFileError,
                      ["'general.architecture'", "twice"]),
    # a bad value before the architecture key is found while looking for that key
    "arch_after_bad_array": (head(0, 2) + kv("x", ARR, struct.pack("<IQ", U8, 1 << 40)) + ARCH,
                             ModelFileError, ["'x'", "1099511627776"]),
    "n_dims": (one_tensor((8, 1, 1, 1, 1)), ModelFileError, ["tensor 'w'", "5 dimensions"]),
    "n_dims_huge": (one_tensor((8,), n_dims=1 << 31), ModelFileError, ["tensor 'w'", "dimensions"]),
    "zero_dim": (one_tensor((8, 0)), ModelFileError, ["tensor 'w'", "dimension of 0"]),
    "huge_dim": (one_tensor((1 << 40,)), ModelFileError, ["tensor 'w'", "needs bytes up to"]),
    "dims_overflow": (one_tensor((1 << 32, 1 << 32, 1 << 32)), ModelFileError,
                      ["tensor 'w'", "multiply to"]),
    "offset_past_end": (one_tensor((8,), offset=1 << 40), ModelFileError,
                        ["tensor 'w'", "needs bytes up to"]),
    "offset_unaligned": (one_tensor((8,), offset=4), ModelFileError,
                         ["tensor 'w'", "offset 4", "alignment 32"]),
    "alignment_not_pow2": (with_data(head(1, 2) + ARCH + kv("general.alignment", U32, struct.pack(
        "<I", 24)) + tensor("w", (8,))), ModelFileError, ["'general.alignment'", "power of two"]),
    "alignment_zero": (with_data(head(1, 2) + ARCH + kv("general.alignment", U32, struct.pack(
        "<I", 0)) + tensor("w", (8,))), ModelFileError, ["'general.alignment'", "power of two"]),
    "alignment_type": (with_data(head(1, 2) + ARCH + kv("general.alignment", U64, struct.pack(
        "<Q", 32)) + tensor("w", (8,))), ModelFileError, ["'general.alignment'", "UINT32"]),
    "ggml_type": (one_tensor((8,), ggml_type=201), UnsupportedModelError, ["tensor 'w'", "201"]),
    "block_misfit": (one_tensor((33, 2), ggml_type=Q4_0), ModelFileError,
                     ["tensor 'w'", "block size 32"]),
    "duplicate_tensor": (with_data(head(2, 1) + ARCH + tensor("w", (8,)) + tensor("w", (8,))),
                         ModelFileError, ["tensor 'w'", "twice"]),
    "tensor_name_length": (with_data(head(1, 1) + ARCH + struct.pack("<Q", 1 << 40)),
                           ModelFileError, ["name of tensor 0"]),
    "truncated_header": (VALID_HEADER[:-4], ModelFileError,
                         ["truncated or corrupt", "data offset of tensor 'b'", "re-download"]),
    "truncated_in_kv": (head(0, 1) + ARCH[:-3], ModelFileError,
                        ["value of key 'general.architecture'", "needs 5 bytes"]),
    "version_1": (head(0, 1, version=1) + ARCH, ModelFileError, ["GGUF version 1"]),
    "version_9": (head(0, 1, version=9) + ARCH, ModelFileError, ["GGUF version 9"]),
    "big_endian": (b"GGUF" + struct.pack(">IQQ", 3, 0, 1) + ARCH, ModelFileError, ["big-endian"]),
    "no_counts": (b"GGUF\3\0\0\0", ModelFileError, ["tensor count"]),
}
RSS_LIMIT_MB = 200


def _worker(folder: str) -> None:
    """Parse every case (plainly, then with an architecture check) and report the error,
    the time and the peak-RSS growth; address space is capped so that a regression fails
    with MemoryError here instead of swapping the machine."""
    import resource
    from pathlib import Path

    def rss_mb():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
    read_header(_write(Path(folder) / "valid.gguf", VALID))  # warm up
    base, out = rss_mb(), {}
    for name, (data, _, _) in CASES.items():
        path = _write(Path(folder) / f"{name}.gguf", data)
        for mode, check in (("plain", None), ("arch_first", lambda arch: None)):
            t0 = time.perf_counter()
            try:
                read_header(path, check_arch=check)
                err = (None, "parsed without error")
            except Exception as exc:  # reported, judged by the test
                err = (type(exc).__name__, str(exc))
            out[f"{name}/{mode}"] = dict(error=err[0], message=err[1], path=str(path),
                                         seconds=time.perf_counter() - t0,
                                         rss_growth_mb=rss_mb() - base)
    print(json.dumps(out))


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.fixture(scope="module")
def crafted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("crafted")
    r = subprocess.run([sys.executable, __file__, str(folder)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_valid_crafted_header_parses(tmp_path):
    h = read_header(_write(tmp_path / "valid.gguf", VALID))
    assert h.metadata == {"general.architecture": "llama", "general.alignment": 32}
    assert [(t.name, t.shape, t.n_bytes) for t in h.tensors] == [("a", (2, 8), 64), ("b", (4,), 16)]
    assert h.data_offset == len(VALID) - 96 and h.data_offset % 32 == 0
    assert h.tensors[1].data_offset == h.data_offset + 64


@pytest.mark.parametrize("case", list(CASES))
def test_crafted_header_fails_fast(crafted, case):
    _, exc_type, words = CASES[case]
    for mode in ("plain", "arch_first"):
        r = crafted[f"{case}/{mode}"]
        print(f"{mode}: {r['error']} in {r['seconds'] * 1e3:.2f} ms, peak RSS "
              f"+{r['rss_growth_mb']:.1f} MB: {r['message']}")
        assert r["error"] == exc_type.__name__, r
        for word in [r["path"], *words]:
            assert word in r["message"], (word, r["message"])
        assert r["seconds"] < 1.0 and r["rss_growth_mb"] < RSS_LIMIT_MB


def test_matches_gguf_reader(smollm2_path):
    """The gguf package's reader is the oracle on a real file: every value, type and tensor."""
    import gguf
    import numpy as np

    t0 = time.perf_counter()
    h = read_header(smollm2_path)
    took = time.perf_counter() - t0
    ref = gguf.GGUFReader(str(smollm2_path))
    print(f"SmolLM2 header: {took * 1e3:.0f} ms, {len(h.metadata)} keys, {len(h.tensors)} tensors")
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(h.metadata) == keys
    for key in keys:
        value = ref.fields[key].contents()
        value = value.item() if isinstance(value, np.generic) else value
        assert h.metadata[key] == value and type(h.metadata[key]) is type(value), key
        assert h.value_types[key] == list(ref.fields[key].types), key
    assert h.data_offset == ref.data_offset and h.alignment == ref.alignment
    assert [(t.name, t.ggml_type, t.shape, t.n_bytes, t.data_offset) for t in h.tensors] == [
        (t.name, t.tensor_type.name, tuple(int(d) for d in t.shape[::-1]), int(t.n_bytes),
         int(t.data_offset)) for t in ref.tensors]



def test_raw_and_tensor_match_gguf_reader(tmp_path):
    """Typed values for the plain types, bytes in ggml's byte shape for the others, at the
    same offsets as the gguf package's reader (one tensor per type it can write)."""
    import gguf
    import numpy as np

    from kvcompile.io.gguf.reader import open_gguf

    rng = np.random.default_rng(0)
    qt = gguf.GGMLQuantizationType
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for t in (qt.F32, qt.F16, qt.BF16, qt.Q8_0, qt.Q4_0, qt.Q4_1, qt.Q5_0, qt.Q5_1):
        x = rng.standard_normal((3, 64)).astype(np.float32)
        w.add_tensor(t.name, gguf.quants.quantize(x, t) if t != qt.F32 else x, raw_dtype=t)
    w.add_tensor("I32", np.arange(24, dtype=np.int32).reshape(2, 3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f, ref = open_gguf(path), gguf.GGUFReader(str(path))
    assert list(f.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        raw = f.raw(t.name)
        assert raw.dtype == t.data.dtype and raw.shape == t.data.shape, t.name
        assert np.array_equal(raw, t.data), t.name
        want = (np.array(t.data, dtype=np.float32) if t.name == "I32" else
                gguf.quants.dequantize(np.array(t.data), t.tensor_type))
        want = np.asarray(want, dtype=np.float32).reshape(f.tensors[t.name].shape)
        assert np.array_equal(f.tensor(t.name).numpy(), want), t.name


N_VOCAB = 262144


def _big_vocab_gguf(path, arch: str):
    """A header-only GGUF with a 262K-token vocabulary, types and merges (gguf's writer)."""
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", 1)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(N_VOCAB)])
    w.add_token_types([1] * N_VOCAB)
    w.add_token_merges([f"t{i} o{i}" for i in range(N_VOCAB)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _refusal_seconds(fn, path) -> float:
    t0 = time.perf_counter()
    with pytest.raises(UnsupportedModelError) as info:
        fn(path)
    took = time.perf_counter() - t0
    print(f"{fn.__module__}.{fn.__name__}: refused in {took * 1e3:.1f} ms: {info.value}")
    assert "'gemma9'" in str(info.value) and "llama" in str(info.value)
    return took


def test_unsupported_arch_refused_before_vocabulary(tmp_path, monkeypatch):
    """Was 12-13 s for each of these entry points (the whole vocabulary parsed first); now
    no string array is decoded before the refusal."""
    from kvcompile.io.gguf import header
    from kvcompile.io.loader import read_config
    from kvcompile.io.model_info import model_info
    from kvcompile.io.weights import load_weights

    decoded = []
    string_array = header._Parser.string_array

    def spy(self, n, key, decode=True):
        decoded.extend([key] if decode else [])
        return string_array(self, n, key, decode)

    monkeypatch.setattr(header._Parser, "string_array", spy)
    path = _big_vocab_gguf(tmp_path / "gemma9.gguf", "gemma9")
    for fn in (read_config, load_weights, model_info):
        assert _refusal_seconds(fn, path) < 0.5
    # the architecture key after the vocabulary: the tokens are skipped undecoded
    late = tmp_path / "late_arch.gguf"
    tokens = b"".join(s(f"tok{i}") for i in range(N_VOCAB))
    late.write_bytes(head(0, 2) + kv("tokenizer.ggml.tokens", ARR, struct.pack("<IQ", STR, N_VOCAB))
                     + tokens + kv("general.architecture", STR, s("gemma9")))
    assert _refusal_seconds(read_config, late) < 0.5
    assert decoded == []
    assert len(read_header(late).metadata["tokenizer.ggml.tokens"]) == N_VOCAB
    assert decoded == ["tokenizer.ggml.tokens"]


def test_big_vocabulary_parses_fast(tmp_path):
    path = _big_vocab_gguf(tmp_path / "llama.gguf", "llama")
    t0 = time.perf_counter()
    h = read_header(path)
    took = time.perf_counter() - t0
    print(f"{N_VOCAB} tokens, types and merges parsed in {took * 1e3:.0f} ms")
    md = h.metadata
    assert md["tokenizer.ggml.tokens"][-1] == f"tok{N_VOCAB - 1}"
    assert md["tokenizer.ggml.merges"][7] == "t7 o7"
    assert md["tokenizer.ggml.token_type"] == [1] * N_VOCAB
    assert took < 1.0  # ~0.2 s measured; slack for 2 shared cores


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "kvcompile", *args], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("command", ["info", "generate"])
def test_cli_reports_crafted_file_in_one_line(tmp_path, command):
    path = _write(tmp_path / "issue30.gguf", CASES["issue"][0])
    args = ["info", str(path)] if command == "info" else ["generate", "-m", str(path), "hi",
                                                          "--no-progress"]
    r = _cli(*args)
    print(r.stderr)
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcompile: error:")
    assert "'general.architecture'" in lines[0] and str(path) in lines[0]


def test_engine_loads_after_refused_files(tmp_path):
    from kvcompile import Engine

    with pytest.raises(ModelFileError, match="general.architecture"):
        Engine(_write(tmp_path / "issue30.gguf", CASES["issue"][0]), progress=False)
    with pytest.raises(UnsupportedModelError, match="gemma9"):
        Engine(_big_vocab_gguf(tmp_path / "gemma9.gguf", "gemma9"), progress=False)
    r = Engine(None, ctx_size=256, progress=False).generate("Hello", max_tokens=2, temperature=0)
    assert len(r.token_ids) == 2


if __name__ == "__main__":
    _worker(sys.argv[1])


def test_info_shows_an_unsupported_file_and_says_so(tmp_path):
    """`kvcompile info` on a file of another family prints what its header says (metadata,
    arrays as their length) and then the one-line refusal naming the supported families."""
    import subprocess
    import sys
    path = _big_vocab_gguf(tmp_path / "gemma9.gguf", "gemma9")
    r = subprocess.run([sys.executable, "-m", "kvcompile", "info", str(path)],
                       capture_output=True, text=True, timeout=120)
    print(r.stdout, r.stderr)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "gemma9.block_count" in r.stdout and f"[{N_VOCAB} values]" in r.stdout
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("kvcompile: error:") and "'gemma9' is not supported" in last
