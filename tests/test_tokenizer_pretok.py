"""Every supported pre-tokenizer against llama.cpp: SmolLM2's BPE vocabulary written into a
vocab-only GGUF under another `tokenizer.ggml.pre` value, so llama.cpp splits with that
pre-tokenizer's rules (and flags: ignore_merges, add_bos, clean_spaces)."""
from __future__ import annotations

import pytest

from kvcompile.io.tokenizer import Tokenizer
from kvcompile.io.tokenizer.pretokenize import PRE_TOKENIZERS, PreTokenizer, pre_tokenizer_spec
from tokenizer_oracle import (
    fresh_rng, gguf_metadata, LlamaVocab, random_chunks, random_text, read_corpus,
    write_vocab_gguf,
)

PRE_NAMES = ["default", "gpt-2", "llama-bpe", "qwen2", "qwen35", "starcoder", "dbrx", "stablelm2"]


@pytest.fixture(scope="module")
def smollm_vocab(smollm2_path):
    meta = gguf_metadata(str(smollm2_path))
    return {k: meta[f"tokenizer.ggml.{k}"] for k in ("tokens", "token_type", "merges")}


@pytest.fixture(scope="module")
def corpus():
    return read_corpus()


def both_tokenizers(pre, vocab, tmp_path):
    """(kvcompile, llama.cpp) tokenizers of SmolLM2's vocabulary under `pre`."""
    path = write_vocab_gguf(tmp_path / f"vocab-{pre}.gguf", model="gpt2", pre=pre,
                            tokens=vocab["tokens"], token_types=vocab["token_type"],
                            merges=vocab["merges"], bos=1, eos=2)
    tok = Tokenizer.from_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": vocab["tokens"], "tokenizer.ggml.token_type": vocab["token_type"],
        "tokenizer.ggml.merges": vocab["merges"],
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2})
    return tok, LlamaVocab(path)


@pytest.mark.parametrize("pre", PRE_NAMES)
def test_pre_tokenizer_matches_llama_cpp(pre, smollm_vocab, corpus, tmp_path):
    tok, oracle = both_tokenizers(pre, smollm_vocab, tmp_path)

    assert tok.encode(corpus) == oracle.tokenize(corpus, add_bos=True)  # add_bos follows pre
    rng = fresh_rng(pre)
    texts = (corpus.splitlines(keepends=True) + random_chunks(rng, corpus, 60)
             + [random_text(rng, corpus, rng.randint(1, 60)) for _ in range(150)])
    bad = [t for t in texts if tok.encode(t, add_bos=False) != oracle.tokenize(t)]
    detok_bad = 0
    for t in texts[::3]:
        ids = tok.encode(t)
        for skip in (False, True):
            detok_bad += tok.decode_bytes(ids, skip) != oracle.detokenize(ids, skip, not skip)
    print(f"pre={pre}: add_bos={tok.add_bos}, {len(tok.encode(corpus))} corpus tokens, "
          f"{len(texts)} texts, {len(bad)} encode and {detok_bad} decode mismatches")
    assert bad == [], repr(bad[:3])
    assert detok_bad == 0


def test_pre_tokenizer_aliases_match_llama_cpp(smollm_vocab, corpus, tmp_path):
    """Every `pre` name kvcompile accepts means the same to llama.cpp (a fresh sample of the
    aliases each run: encode with BOS as configured, and decode with clean-up as configured)."""
    rng = fresh_rng("aliases")
    names = rng.sample(sorted(set(PRE_TOKENIZERS) - set(PRE_NAMES)), 4)
    for pre in names:
        tok, oracle = both_tokenizers(pre, smollm_vocab, tmp_path)
        ids = tok.encode(corpus)
        assert ids == oracle.tokenize(corpus, add_bos=True), pre
        assert tok.decode_bytes(ids, True) == oracle.detokenize(ids, True, False), pre
        print(f"pre={pre} ({tok._pre.spec.name} rules): {len(ids)} tokens equal")


# Splits worked out by hand from each pre-tokenizer's rules (independent of both programs):
# digits grouped by 3 / kept whole / split singly, case-insensitive contractions, a combining
# mark (U+0301) joining letters only for qwen35, punctuation keeping trailing newlines.
_TEXT = "ab 1234 it'S x\u0301y!!\n\n  z"
_EXPECTED_SPLITS = {
    "default": ["ab", " ", "123", "4", " it", "'", "S", " x", "\u0301", "y", "!!", "\n\n ", " z"],
    "gpt-2": ["ab", " 1234", " it", "'", "S", " x", "\u0301", "y", "!!", "\n\n ", " z"],
    "smollm": ["ab", " ", "1", "2", "3", "4", " it", "'", "S", " x", "\u0301", "y", "!!", "\n\n ", " z"],
    "llama-bpe": ["ab", " ", "123", "4", " it", "'S", " x", "\u0301y", "!!\n\n", " ", " z"],
    "qwen2": ["ab", " ", "1", "2", "3", "4", " it", "'S", " x", "\u0301y", "!!\n\n", " ", " z"],
    "qwen35": ["ab", " ", "1", "2", "3", "4", " it", "'S", " x\u0301y", "!!\n\n", " ", " z"],
}


@pytest.mark.parametrize("pre", sorted(_EXPECTED_SPLITS))
def test_pre_token_splits_match_hand_derived(pre):
    pieces = PreTokenizer(pre_tokenizer_spec(pre)).split(_TEXT)
    print(pre, pieces)
    assert pieces == _EXPECTED_SPLITS[pre]
