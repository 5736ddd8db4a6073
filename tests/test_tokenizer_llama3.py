"""The real Llama 3 vocabulary against llama.cpp, pre-tokenizer "llama-bpe".

The vocabulary is Meta's `llama_models/llama3/tokenizer.model` from the `llama-models` wheel
(installed with --no-deps by ./dev): a tiktoken file, one `<base64 of the bytes> <rank>` line
for each of 128,000 byte-level BPE tokens; the 256 special tokens follow at 128000..128255.
The test writes it as a vocab-only GGUF the way Llama 3 GGUFs carry it: GPT-2 byte-to-char
token texts and merges derived from the ranks, every split of a token into two shorter
tokens, ordered by the rank of the result (280,147 merges, as in Llama 3's tokenizer.json).

Checked: kvcompile's tokenizer against llama.cpp's on the mixed-text corpus, its lines, fresh
random chunks and strings, special-token strings and detokenization; and, independently of
both, that the merges we wrote mean Meta's tokenizer: the corpus split by Meta's regex and
each piece encoded by rank (tiktoken's algorithm) gives kvcompile's ids.
"""
from __future__ import annotations

import base64
import importlib.util
from pathlib import Path

import pytest
import regex

from kvcompile.io.tokenizer import load_tokenizer
from kvcompile.io.tokenizer.bpe import BytePairEncoder, bytes_to_bpe_text, parse_merges
from tokenizer_oracle import (
    fresh_rng, LlamaVocab, random_chunks, random_text, read_corpus, write_vocab_gguf,
)

_SPECIAL_NAMES = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
    "<|image|>",
]
SPECIALS = _SPECIAL_NAMES + [f"<|reserved_special_token_{i}|>" for i in range(2, 246)]
BOS, EOT = 128000, 128009
# Meta's pre-tokenizer regex (llama_models/llama3/tokenizer.py), for the independent check
META_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def read_ranks() -> dict[bytes, int]:
    """Token bytes -> rank, read without importing llama_models (its imports need torch...)."""
    spec = importlib.util.find_spec("llama_models")
    if spec is None:
        pytest.fail("the Llama 3 vocabulary is missing: run `.venv/bin/python -m pip install "
                    "--no-deps llama-models==0.3.0` (./dev installs it)")
    path = Path(next(iter(spec.submodule_search_locations))) / "llama3" / "tokenizer.model"
    ranks = {}
    for line in path.read_bytes().splitlines():
        b64, rank = line.split()
        ranks[base64.b64decode(b64)] = int(rank)
    return ranks


def merges_from_ranks(ranks: dict[bytes, int]) -> list[str]:
    """Every (left, right) with left + right a token and both parts tokens, by the rank of
    left + right, then of left, then of right. One merge per token is not enough: 678 Llama 3
    tokens (e.g. '.:.:') are never reached by merging the lower-ranked tokens only."""
    merges = []
    for token in sorted(ranks, key=ranks.get):
        splits = sorted((ranks[token[:i]], ranks[token[i:]], i) for i in range(1, len(token))
                        if token[:i] in ranks and token[i:] in ranks)
        merges += [f"{bytes_to_bpe_text(token[:i])} {bytes_to_bpe_text(token[i:])}"
                   for _, _, i in splits]
    return merges


def rank_bpe(ranks: dict[bytes, int], data: bytes) -> list[int]:
    """tiktoken's algorithm: merge the adjacent pair whose concatenation ranks lowest
    (leftmost on ties) until no concatenation is a token."""
    parts = [data[i:i + 1] for i in range(len(data))]
    while len(parts) > 1:
        best = min(range(len(parts) - 1),
                   key=lambda i: ranks.get(parts[i] + parts[i + 1], len(ranks)))
        if parts[best] + parts[best + 1] not in ranks:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return [ranks[p] for p in parts]


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """(ranks, merges, kvcompile tokenizer, llama.cpp tokenizer) of one vocab-only GGUF."""
    ranks = read_ranks()
    tokens = [bytes_to_bpe_text(t) for t in sorted(ranks, key=ranks.get)]
    assert len(tokens) == 128_000 and len(SPECIALS) == 256
    merges = merges_from_ranks(ranks)
    path = write_vocab_gguf(tmp_path_factory.mktemp("llama3") / "llama3-vocab.gguf",
                            model="gpt2", pre="llama-bpe", tokens=tokens + SPECIALS,
                            token_types=[1] * len(tokens) + [3] * len(SPECIALS), merges=merges,
                            bos=BOS, eos=EOT, add_bos=True)  # instruct GGUFs: eos = <|eot_id|>
    return ranks, merges, load_tokenizer(path), LlamaVocab(path)


@pytest.fixture(scope="module")
def corpus():
    text = read_corpus()
    assert len(text.encode("utf-8")) >= 20_000
    return text


def test_vocabulary_is_llama3(llama3):
    ranks, merges, tok, oracle = llama3
    assert len(merges) == 280_147
    assert tok.vocab_size == oracle.n_vocab == 128_256
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (oracle.bos, oracle.eos, True)
    assert (tok.bos_id, tok.eos_id) == (BOS, EOT)
    assert tok.token_id("<|start_header_id|>") == 128006 and tok.token_id("<|eot_id|>") == EOT
    assert tok.token_bytes(ranks[b" the"]) == b" the"
    assert set(tok.stop_ids) == {i for i in range(128_000, 128_256) if oracle.is_eog(i)}


def test_corpus_lines_and_random_text_match_llama_cpp(llama3, corpus):
    _, _, tok, oracle = llama3
    ids = tok.encode(corpus)
    assert ids == oracle.tokenize(corpus, add_bos=True)
    rng = fresh_rng("llama3")
    texts = (corpus.splitlines(keepends=True) + random_chunks(rng, corpus, 300)
             + [random_text(rng, corpus, rng.randint(1, 80)) for _ in range(400)])
    bad = [t for t in texts if tok.encode(t, add_bos=False) != oracle.tokenize(t)]
    print(f"corpus: {len(corpus.encode())} bytes, {len(ids)} tokens with BOS; "
          f"{len(texts)} lines/chunks/strings, {len(bad)} differ")
    assert bad == [], repr(bad[:3])


def test_special_tokens_match_llama_cpp(llama3, corpus):
    _, _, tok, oracle = llama3
    rng = fresh_rng("llama3-special")
    chat = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nhi <|eot_id|><|start_header_id|>"
            "assistant<|end_header_id|>\n\n")
    look_alikes = ["<|eot_id", "<|eot_id|", "<|EOT_ID|>", "<|reserved_special_token_246|>",
                   "<|begin_of_text|>>", " <|python_tag|>", "<|<|image|>|>"]
    texts = [chat] + [
        "".join(rng.choice([rng.choice(SPECIALS), rng.choice(look_alikes),
                            random_text(rng, corpus, rng.randint(1, 30))])
                for _ in range(rng.randint(1, 8)))
        for _ in range(200)]
    for text in texts:
        for special in (True, False):
            assert tok.encode(text, add_bos=False, parse_special=special) == \
                oracle.tokenize(text, special=special), (text, special)
    assert tok.encode(chat, add_bos=False)[:3] == [BOS, 128006, tok.token_id("system")]


def test_decode_round_trips_and_matches_llama_cpp(llama3, corpus):
    _, _, tok, oracle = llama3
    rng = fresh_rng("llama3-decode")
    texts = (corpus.splitlines(keepends=True) + random_chunks(rng, corpus, 100)
             + [random_text(rng, corpus, 60) for _ in range(200)])
    # the tokens' bytes give the text back; decode() also applies llama.cpp's clean-up of
    # spaces before punctuation (on for llama-bpe), so it is compared with llama.cpp's
    for text in [corpus] + texts:
        ids = tok.encode(text)
        assert b"".join(map(tok.token_bytes, ids[1:])) == text.encode("utf-8")
        for skip in (False, True):
            assert tok.decode_bytes(ids, skip) == oracle.detokenize(ids, skip, not skip)
    for _ in range(300):  # arbitrary ids: specials, split multi-byte characters, BOS anywhere
        ids = [rng.randrange(128_256) for _ in range(rng.randint(1, 10))]
        ids += [BOS, rng.randrange(128_000, 128_256)]
        rng.shuffle(ids)
        for skip in (False, True):
            assert tok.decode_bytes(ids, skip) == oracle.detokenize(ids, skip, not skip), ids


def test_merges_mean_meta_rank_order(llama3, corpus):
    """Independent of kvcompile and llama.cpp: Meta's split regex, then each piece a token
    if it is one, else merged by rank. Also the bare merge loop (no whole-piece lookup) on
    every piece and on a sample of the vocabulary's own tokens."""
    ranks, merges, tok, _ = llama3
    pieces = regex.findall(META_SPLIT, corpus)
    ref = [BOS]
    for piece in pieces:
        data = piece.encode("utf-8")
        ref += [ranks[data]] if data in ranks else rank_bpe(ranks, data)
    assert tok.encode(corpus) == ref
    bare = BytePairEncoder(tok._token_to_id, parse_merges(merges), ignore_merges=False)
    rng = fresh_rng("llama3-merges")
    words = sorted(set(pieces)) + [t.decode("utf-8", "replace")
                                   for t in rng.sample(sorted(ranks), 3000)]
    bad = [w for w in words
           if list(bare.encode_word(w)) != rank_bpe(ranks, w.encode("utf-8"))]
    n_merged = sum(p.encode("utf-8") not in ranks for p in pieces)
    print(f"{len(pieces)} corpus pieces ({n_merged} not one token) and {len(words)} words: "
          f"{len(bad)} differ from rank-order BPE")
    assert bad == [], bad[:5]
