"""SmolLM2 (byte-level BPE, pre = 'smollm') against llama.cpp's tokenizer on the same GGUF."""
from __future__ import annotations

import time

import pytest

from kvcompile.errors import KvcompileError, ModelFileError, UnsupportedModelError
from kvcompile.io.tokenizer.bpe import BYTE_TO_CHAR
from kvcompile.io.tokenizer import StreamDecoder, Tokenizer, TokenizerError, load_tokenizer
from tokenizer_oracle import (
    fresh_rng, gguf_metadata, LlamaVocab, random_chunks, random_text, read_corpus,
)


@pytest.fixture(scope="module")
def smollm_meta(smollm2_path):
    return gguf_metadata(str(smollm2_path))


@pytest.fixture(scope="module")
def tok(smollm_meta):
    return Tokenizer.from_metadata(smollm_meta)


@pytest.fixture(scope="module")
def oracle(smollm2_path):
    return LlamaVocab(smollm2_path)


@pytest.fixture(scope="module")
def corpus():
    text = read_corpus()
    assert len(text.encode("utf-8")) >= 20_000
    return text


def test_whole_corpus_matches_llama_cpp(smollm_meta, oracle, corpus):
    fresh = Tokenizer.from_metadata(smollm_meta)  # empty word cache: time a cold encode
    t0 = time.perf_counter()
    ours = fresh.encode(corpus)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    fresh.encode(corpus)
    warm = time.perf_counter() - t0
    ref = oracle.tokenize(corpus)
    print(f"corpus: {len(corpus.encode())} bytes, {len(ours)} tokens (llama.cpp {len(ref)}); "
          f"encode cold {cold * 1e3:.1f} ms, warm {warm * 1e3:.1f} ms")
    assert ours == ref
    assert cold < 2.0


def test_lines_and_random_chunks_match_llama_cpp(tok, oracle, corpus):
    rng = fresh_rng("chunks")
    pieces = corpus.splitlines(keepends=True) + random_chunks(rng, corpus, 300)
    mismatches = [p for p in pieces if tok.encode(p) != oracle.tokenize(p)]
    print(f"{len(pieces)} lines/chunks compared, {len(mismatches)} differ")
    assert mismatches == []


def test_random_strings_match_llama_cpp(tok, oracle, corpus):
    rng = fresh_rng("random")
    texts = [random_text(rng, corpus, rng.randint(1, 80)) for _ in range(600)]
    mismatches = [t for t in texts if tok.encode(t) != oracle.tokenize(t)]
    print(f"{len(texts)} random strings compared, {len(mismatches)} differ")
    assert mismatches == [], repr(mismatches[:3])


def test_special_tokens_and_bos_flags_match_llama_cpp(tok, oracle, corpus):
    start = corpus.index("## Special-token look-alikes")
    section = corpus[start:corpus.index("## Contractions", start)]
    for special in (True, False):
        assert tok.encode(section, parse_special=special) == oracle.tokenize(section, special=special)
    # llama.cpp's add_special follows the metadata (add_bos_token = false here), as does None
    assert tok.encode(section) == oracle.tokenize(section, add_bos=True)
    assert tok.encode("hi", add_bos=True) == [tok.bos_id] + oracle.tokenize("hi")
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.token_id("<|im_start|>") and ids[-1] == tok.token_id("<|im_end|>")
    assert tok.token_id("<|im_start|>") not in tok.encode("<|im_start|>", parse_special=False)


def test_decode_roundtrip_and_llama_cpp_detokenize(tok, oracle, corpus):
    rng = fresh_rng("decode")
    texts = corpus.splitlines(keepends=True) + [random_text(rng, corpus, 60) for _ in range(200)]
    # SmolLM2 has no token for some bytes (e.g. 0x1D): llama.cpp drops them, and so do we
    missing = {b for b in range(256) if tok.token_id(BYTE_TO_CHAR[b]) is None}
    n_roundtrip = 0
    for text in texts:
        ids = tok.encode(text)
        if not missing.intersection(text.encode("utf-8")):
            assert tok.decode(ids) == text
            n_roundtrip += 1
        for skip in (False, True):
            assert tok.decode_bytes(ids, skip_special=skip) == oracle.detokenize(ids, skip, not skip)
    assert tok.decode(tok.encode(corpus)) == corpus.replace("\x1d", "")
    # arbitrary id sequences, including control tokens and split multi-byte characters
    n_checked = 0
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))]
        ids += rng.sample(range(17), 2)
        rng.shuffle(ids)
        for skip in (False, True):
            assert tok.decode_bytes(ids, skip_special=skip) == oracle.detokenize(ids, skip, not skip)
            n_checked += 1
    print(f"{n_roundtrip}/{len(texts)} texts round-trip exactly (the rest hold bytes without a "
          f"token: {sorted(missing)}); {n_checked} random id sequences detokenized like llama.cpp")


def test_long_words_match_llama_cpp_quickly(tok, oracle):
    """Single pre-tokens thousands of characters long (a merge order kept in a heap)."""
    rng = fresh_rng("long")
    b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    texts = ["a" * rng.randint(2000, 6000), " " * rng.randint(500, 3000) + "x",
             "".join(rng.choice(b64[:52]) for _ in range(rng.randint(1000, 4000))),
             "é" * rng.randint(100, 900), "\n" * rng.randint(100, 900),
             "".join(rng.choice("!?.,;:-_=+*") for _ in range(rng.randint(500, 2000)))]
    for text in texts:
        t0 = time.perf_counter()
        ours = tok.encode(text)
        elapsed = time.perf_counter() - t0
        print(f"{len(text)} chars {text[:3]!r}...: {len(ours)} tokens in {elapsed * 1e3:.1f} ms")
        assert ours == oracle.tokenize(text)
        assert elapsed < 1.0


def test_token_bytes_match_llama_cpp_pieces(tok, oracle):
    rng = fresh_rng("pieces")
    for tid in list(range(40)) + rng.sample(range(tok.vocab_size), 500):
        assert tok.token_bytes(tid) == oracle.detokenize([tid], False, True)
        assert tok.token_bytes(tid, special=False) == oracle.detokenize([tid], False, False)


def test_stream_decoder_holds_back_partial_characters(tok, corpus):
    text = "Emoji 🚢⚓ and 日本語, Ελληνικά, العربية — ok."
    ids = tok.encode(text)
    dec = StreamDecoder(tok)
    pieces = [dec.feed(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # some token of the emoji carries only part of its 4 bytes, and yields no text by itself
    assert any(p == "" for p in pieces[:-1])
    # control tokens are skipped by default, rendered on request
    assert StreamDecoder(tok).feed(tok.token_id("<|im_end|>")) == ""
    assert StreamDecoder(tok, skip_special=False).feed(tok.token_id("<|im_end|>")) == "<|im_end|>"
    # an incomplete character left at the end becomes one replacement character
    dec = StreamDecoder(tok)
    partial = [i for i in tok.encode("🚢") if len(tok.token_bytes(i)) < 4][:1]
    assert [dec.feed(i) for i in partial] == [""] and dec.flush() == "\ufffd"


def test_properties_match_llama_cpp(tok, oracle):
    assert tok.vocab_size == oracle.n_vocab == 49152
    assert (tok.bos_id, tok.eos_id) == (oracle.bos, oracle.eos)
    assert set(tok.stop_ids) == {tok.token_id("<|endoftext|>"), tok.token_id("<|im_end|>")}
    assert all(oracle.is_eog(i) for i in tok.stop_ids)
    print("stop ids:", tok.stop_ids, [tok.token_text(i) for i in tok.stop_ids])


def test_load_tokenizer_from_file(smollm2_path, tok):
    loaded = load_tokenizer(smollm2_path)
    assert loaded.encode("Hello, world! 42") == tok.encode("Hello, world! 42")


def test_bad_metadata_and_ids_raise_clear_errors(smollm_meta, tok):
    for key, value, error, needle in [
        ("tokenizer.ggml.model", "bert", UnsupportedModelError, "'bert'"),
        ("tokenizer.ggml.pre", "klingon-bpe", UnsupportedModelError, "'klingon-bpe'"),
        ("tokenizer.ggml.tokens", None, ModelFileError, "tokenizer.ggml.tokens"),
        ("tokenizer.ggml.merges", None, ModelFileError, "tokenizer.ggml.merges"),
        ("tokenizer.ggml.token_type", [1, 2, 3], ModelFileError, "token types"),
        ("tokenizer.ggml.tokens", [1, 2], ModelFileError, "list of strings"),
        ("tokenizer.ggml.token_type", ["1"] * 49152, ModelFileError, "list of integers"),
    ]:
        meta = {k: v for k, v in smollm_meta.items() if not (k == key and value is None)}
        if value is not None:
            meta[key] = value
        with pytest.raises(error, match=needle.replace("(", r"\(")) as info:
            Tokenizer.from_metadata(meta)
        print(f"{key}={str(value)[:20]!r}: {info.value}")
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([5, 49152])
    with pytest.raises(KvcompileError):
        tok.token_bytes(-1)
    with pytest.raises(TokenizerError, match="str"):
        tok.encode(b"bytes")
    with pytest.raises(TokenizerError, match="surrogate"):
        tok.encode("bad \ud800 text")
