"""llama SentencePiece (SPM) vocabularies against llama.cpp: a small vocab built here from the
test corpus (a few hundred scored pieces, byte fallback, control / unknown / user-defined
tokens) is written as a vocab-only GGUF; both tokenizers encode and decode the same texts."""
from __future__ import annotations

import collections
import math

import pytest

from kvcompile.io.tokenizer import Tokenizer, TokenType
from tokenizer_oracle import (
    fresh_rng, LlamaVocab, random_chunks, random_text, read_corpus, write_vocab_gguf,
)

SPACE = "\u2581"


def build_spm_vocab(rng, corpus: str, n_pieces: int = 400):
    """Pieces = frequent substrings of '▁'-prefixed words; scores = log-frequency plus noise,
    rounded to 0.1 so that some pieces tie (llama.cpp then merges the leftmost pair first)."""
    words = [SPACE + w for w in corpus.split() if w.isalpha()]
    counts: collections.Counter[str] = collections.Counter()
    for w in words:
        for n in range(1, 7):
            for i in range(len(w) - n + 1):
                counts[w[i:i + n]] += 1
    singles = [p for p, c in counts.items() if len(p) == 1 and c >= 2]
    multi = sorted((p for p in counts if len(p) > 1), key=lambda p: -counts[p] * (len(p) - 1))
    pieces = singles + multi[:n_pieces]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    for p in pieces:
        tokens.append(p)
        types.append(TokenType.NORMAL)
        scores.append(round(math.log(counts[p]) * len(p) + rng.gauss(0, 0.5), 1))
    for special, kind in (("<|im_end|>", TokenType.CONTROL), ("<tool>", TokenType.USER_DEFINED)):
        tokens.append(special)
        types.append(kind)
        scores.append(0.0)
    return tokens, [int(t) for t in types], scores


@pytest.fixture(scope="module")
def corpus():
    return read_corpus()


@pytest.mark.parametrize("add_space_prefix, add_eos", [(True, False), (False, True)])
def test_spm_matches_llama_cpp(add_space_prefix, add_eos, corpus, tmp_path):
    rng = fresh_rng(f"spm prefix={add_space_prefix} eos={add_eos}")
    tokens, types, scores = build_spm_vocab(rng, corpus)
    path = write_vocab_gguf(tmp_path / "spm.gguf", model="llama", tokens=tokens,
                            token_types=types, scores=scores, bos=1, eos=2,
                            add_space_prefix=add_space_prefix, add_eos=add_eos)
    oracle = LlamaVocab(path)
    scores32 = [float(s) for s in __import__("numpy").asarray(scores, dtype="float32")]
    tok = Tokenizer.from_metadata({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores32,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
        "tokenizer.ggml.add_eos_token": add_eos})
    assert tok.add_bos and tok.add_eos == add_eos and tok.vocab_size == oracle.n_vocab

    extra = ["<s>hello</s>", "a<|im_end|>b", "x <tool> y", "<tool>", "  two spaces", " ",
             "\n", "<|im_end|> after", "<unk>", "mixed <s> and <|im_end|>\n<tool>z"]
    texts = (corpus.splitlines(keepends=True) + extra + random_chunks(rng, corpus, 80)
             + [random_text(rng, corpus, rng.randint(1, 60)) for _ in range(150)])
    n_tokens = 0
    for text in texts:
        for add_special in (False, True):  # llama.cpp's flag adds BOS and EOS as configured
            for special in (True, False):
                ours = tok.encode(text, add_bos=add_special, add_eos=None if add_special else False,
                                  parse_special=special)
                assert ours == oracle.tokenize(text, add_bos=add_special, special=special), repr(text)
                n_tokens += len(ours)
        # a literal '▁' is SPM's space mark (decodes as ' '), and raw text after a
        # user-defined token gets its own space prefix: both are lossy in llama.cpp too
        if SPACE not in text and "<tool>" not in text:
            ids = tok.encode(text, add_bos=False, add_eos=False, parse_special=False)
            assert tok.decode(ids) == text
        ids = tok.encode(text)
        for skip in (False, True):
            assert tok.decode_bytes(ids, skip) == oracle.detokenize(ids, skip, not skip), repr(text)
    whole = tok.encode(corpus)
    assert whole == oracle.tokenize(corpus, add_bos=True)
    assert (whole[-1] == tok.eos_id) == add_eos
    n_fallback = sum(1 for i in whole if tok.token_text(i).startswith("<0x"))
    print(f"SPM vocab {tok.vocab_size} tokens, prefix={add_space_prefix} eos={add_eos}: "
          f"{len(texts)} texts x 4 "
          f"modes ({n_tokens} tokens) equal llama.cpp; corpus {len(whole)} tokens, "
          f"{n_fallback} byte-fallback")


def test_spm_merge_order_follows_scores():
    """Hand-checkable case: with pieces 'ab' (score 1) and 'bc' (score 2), 'abc' merges 'bc'
    first; with the scores swapped it merges 'ab' first; equal scores take the leftmost pair."""
    def encode(score_ab, score_bc):
        tokens = ["<unk>", "<s>", "</s>", "a", "b", "c", "ab", "bc", SPACE]
        types = [2, 3, 3] + [1] * 6
        scores = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, score_ab, score_bc, 0.0]
        tok = Tokenizer.from_metadata({
            "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.add_space_prefix": False})
        return [tok.token_text(i) for i in tok.encode("abc", add_bos=False)]
    assert encode(1.0, 2.0) == ["a", "bc"]
    assert encode(2.0, 1.0) == ["ab", "c"]
    assert encode(1.5, 1.5) == ["ab", "c"]


def test_gemma_shaped_spm_matches_llama_cpp(corpus, tmp_path):
    """A vocab laid out as Gemma 3's (<pad> <eos> <bos> <unk> first, turn markers, then the
    256 byte-fallback tokens and scored pieces with runs of spaces, newlines and tabs; no
    space prefix; BOS added): identical to llama.cpp on the whole corpus (code, Unicode,
    numbers, whitespace runs) and on random pieces of it."""
    rng = fresh_rng("gemma spm")
    tokens, types, scores = build_spm_vocab(rng, corpus)
    pieces = [(t, ty, s) for t, ty, s in zip(tokens, types, scores) if ty == TokenType.NORMAL]
    head = [("<pad>", TokenType.CONTROL), ("<eos>", TokenType.CONTROL),
            ("<bos>", TokenType.CONTROL), ("<unk>", TokenType.UNKNOWN),
            ("<start_of_turn>", TokenType.USER_DEFINED), ("<end_of_turn>", TokenType.CONTROL)]
    whitespace = ([SPACE * n for n in range(2, 32)] + ["\n" * n for n in range(1, 8)]
                  + ["\t" * n for n in range(1, 5)] + ["\n" + SPACE * 4, SPACE + "\n"])
    tokens = [t for t, _ in head] + [f"<0x{b:02X}>" for b in range(256)]
    types = [int(k) for _, k in head] + [int(TokenType.BYTE)] * 256
    scores = [0.0] * len(tokens)
    for i, w in enumerate(whitespace):
        tokens.append(w)
        types.append(int(TokenType.NORMAL))
        scores.append(round(-20.0 - 0.1 * i, 1))
    for t, ty, s in pieces:
        if t not in tokens:
            tokens.append(t)
            types.append(ty)
            scores.append(s)
    path = write_vocab_gguf(tmp_path / "gemma.gguf", model="llama", tokens=tokens,
                            token_types=types, scores=scores, bos=2, eos=1, add_bos=True,
                            add_space_prefix=False)
    oracle = LlamaVocab(path)
    scores32 = [float(s) for s in __import__("numpy").asarray(scores, dtype="float32")]
    tok = Tokenizer.from_metadata({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores32,
        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": False})
    assert len(corpus.encode()) >= 20_000
    whole = tok.encode(corpus)
    assert whole == oracle.tokenize(corpus, add_bos=True) and whole[0] == 2
    texts = (["<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
              "    indented\n\n\n\tcode()", "x" + " " * 40 + "y", "\u2003\u00a0 mixed"]
             + random_chunks(rng, corpus, 60))
    for text in texts:
        for special in (True, False):
            ours = tok.encode(text, parse_special=special)
            assert ours == oracle.tokenize(text, add_bos=True, special=special), repr(text)
        ids = tok.encode(text)
        assert tok.decode_bytes(ids, False) == oracle.detokenize(ids, False, True), repr(text)
    n_ws = sum(1 for i in whole if tok.token_text(i) in whitespace)
    n_fallback = sum(1 for i in whole if tok.token_text(i).startswith("<0x"))
    print(f"Gemma-shaped vocab {tok.vocab_size}: corpus {len(corpus.encode())} bytes -> "
          f"{len(whole)} tokens equal llama.cpp ({n_ws} whitespace-run, {n_fallback} "
          f"byte-fallback tokens)")
    assert n_ws > 0 and n_fallback > 0
