"""Real vocabularies that llama.cpp ships for its own tokenizer tests, against llama.cpp.

The files are `vendor/llama.cpp/models/ggml-vocab-*.gguf` of the llama-cpp-python sdist
(vocab-only GGUFs, each with `.inp` / `.out`: llama.cpp's test strings and the ids it must
give them); `./dev` fetches them once into .cache/llama-vocabs. Loaded through kvcompile's
own GGUF path (`load_tokenizer`):

  qwen2      byte-level BPE, pre-tokenizer "qwen2" (Qwen 1.5 / 2 / 2.5 / 3)
  qwen35     byte-level BPE, pre-tokenizer "qwen35" (Qwen 3.5: marks join letters)
  gemma-4    Gemma 4's SentencePiece-style BPE (model "gemma4"): merges over the raw UTF-8 of
             whole lines, spaces as '▁', `<0xNN>` byte fallback, BOS always
  llama-spm  llama SentencePiece (scored pieces, byte fallback; Llama 2); and the same pieces
             with Gemma 3's settings (no space prefix, BOS added): Gemma 3's GGUFs are this
             algorithm ("llama"), none of the shipped vocabularies is Gemma 3's own

Checked per vocabulary: the `.inp` strings give the `.out` ids (and llama.cpp's); the mixed-
text corpus and fresh random mixed text (>= 20 KB each: code, CJK, emoji, accents, numbers,
whitespace runs) encode whole as llama.cpp does, and so do their lines and random pieces;
special-token texts with and without parse_special; decode round trips and equals
llama.cpp's detokenizer; the end-of-generation ids are llama.cpp's.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from kvcompile.io.tokenizer import TokenType, load_tokenizer
from tokenizer_oracle import (
    fresh_rng, gguf_metadata, LlamaVocab, mixed_text, random_chunks, random_text, read_corpus,
    write_vocab_gguf,
)

VOCAB_DIR = Path(__file__).resolve().parent.parent / ".cache" / "llama-vocabs"
GEMMA3_STYLE = "llama-spm-gemma3-style"   # llama-spm's pieces, written with Gemma 3's flags
VOCABS = ["qwen2", "qwen35", "gemma-4", "llama-spm", GEMMA3_STYLE]
_SEP = "\n__ggml_vocab_test__\n"
SPACE = "\u2581"
# strings that look like (or are) special tokens of some family
LOOK_ALIKES = ["</s>", "<s>", "<eos>", "<bos>", "<unk>", "<|im_end|>", "<|im_start|>",
               "<|endoftext|>", "<turn|>", "<|turn>", "<|tool_response>", "<end_of_turn>",
               "<|im_end", "<|", "|>", "<0x41>", "<pad>", "[multimodal]", "<mask>"]


def vocab_file(name: str) -> Path:
    path = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `./dev setup` (it fetches llama.cpp's vocab files "
                    f"from the llama-cpp-python sdist into {VOCAB_DIR} once)")
    return path


def llama_cpp_cases(name: str) -> list[tuple[str, list[int]]]:
    """(text, ids) pairs of `.inp` / `.out`, split as llama.cpp's test-tokenizer-0 does."""
    path = vocab_file(name)
    raw = Path(f"{path}.inp").read_bytes().decode("utf-8")
    texts, pos = [], 0
    while pos < len(raw):
        nxt = raw.find(_SEP, pos)
        if nxt < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(_SEP)
    outs = Path(f"{path}.out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(outs) >= 40, (len(texts), len(outs))
    return [(t, [int(x) for x in o.split()]) for t, o in zip(texts, outs)]


@pytest.fixture(scope="module", params=VOCABS)
def vocab(request, tmp_path_factory):
    """(name, kvcompile tokenizer, llama.cpp tokenizer) of one vocabulary file."""
    name = request.param
    if name == GEMMA3_STYLE:
        meta = gguf_metadata(str(vocab_file("llama-spm")))
        path = write_vocab_gguf(
            tmp_path_factory.mktemp("vocab") / "gemma3-style.gguf", model="llama",
            tokens=meta["tokenizer.ggml.tokens"], token_types=meta["tokenizer.ggml.token_type"],
            scores=meta["tokenizer.ggml.scores"], bos=1, eos=2, add_bos=True,
            add_space_prefix=False)
    else:
        path = vocab_file(name)
    tok = load_tokenizer(path)
    return name, tok, LlamaVocab(path)


@pytest.fixture(scope="module")
def corpus():
    text = read_corpus()
    assert len(text.encode("utf-8")) >= 20_000
    return text


def special_texts(tok) -> list[str]:
    """The texts of the vocabulary's control / user-defined / unknown tokens."""
    kinds = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)
    return [tok.token_text(i) for i in range(tok.vocab_size) if tok._types[i] in kinds]


def test_llama_cpp_test_strings(vocab):
    name, tok, oracle = vocab
    cases = llama_cpp_cases("llama-spm" if name == GEMMA3_STYLE else name)
    bad = []
    for text, ids in cases:
        ours = tok.encode(text, add_bos=False, parse_special=False)
        theirs = oracle.tokenize(text, special=False)
        if name == GEMMA3_STYLE:   # the .out ids are for a space prefix: llama.cpp only
            ids = theirs
        if not ours == theirs == ids:
            bad.append((text, ours, theirs, ids))
    print(f"{name}: {len(cases)} test strings of llama.cpp, {len(bad)} differ")
    assert bad == [], bad[:3]


def test_mixed_text_matches_llama_cpp(vocab, corpus):
    name, tok, oracle = vocab
    rng = fresh_rng(f"{name}-mixed")
    fresh = mixed_text(rng, 24_000, corpus)
    assert len(fresh.encode("utf-8")) >= 20_000
    for whole in (corpus, fresh):
        ids = tok.encode(whole)
        assert ids == oracle.tokenize(whole, add_bos=True), name
    texts = (corpus.splitlines(keepends=True) + fresh.splitlines(keepends=True)
             + random_chunks(rng, corpus + fresh, 300)
             + [random_text(rng, corpus, rng.randint(1, 80)) for _ in range(300)])
    bad = [t for t in texts if tok.encode(t, add_bos=False) != oracle.tokenize(t)]
    n_fallback = sum(tok.token_text(i).startswith("<0x") for i in tok.encode(fresh))
    print(f"{name}: corpus {len(corpus.encode())} bytes, fresh text {len(fresh.encode())} "
          f"bytes -> {len(tok.encode(fresh))} tokens ({n_fallback} byte-fallback); "
          f"{len(texts)} lines/chunks/strings, {len(bad)} differ")
    assert bad == [], repr(bad[:3])


def test_special_tokens_match_llama_cpp(vocab, corpus):
    name, tok, oracle = vocab
    rng = fresh_rng(f"{name}-special")
    specials = special_texts(tok)
    assert specials, name
    texts = ["".join(rng.choice([rng.choice(specials), rng.choice(LOOK_ALIKES),
                                 random_text(rng, corpus, rng.randint(1, 30))])
                     for _ in range(rng.randint(1, 8)))
             for _ in range(200)]
    for text in texts:
        for special in (True, False):
            assert tok.encode(text, parse_special=special) == \
                oracle.tokenize(text, add_bos=True, special=special), (text, special)


def test_decode_round_trips_and_matches_llama_cpp(vocab, corpus):
    name, tok, oracle = vocab
    rng = fresh_rng(f"{name}-decode")
    fresh = mixed_text(rng, 20_000, corpus)
    prefix = " " if tok.add_space_prefix else ""
    texts = [corpus, fresh] + random_chunks(rng, corpus + fresh, 100)
    for text in texts:
        ids = tok.encode(text, add_bos=False, parse_special=False)
        # the tokens' bytes give the text back; a '▁' in the text of a SentencePiece-style
        # vocabulary comes back as a space (it is how those vocabularies write spaces)
        want = prefix + (text if tok.model == "gpt2" else text.replace(SPACE, " "))
        assert b"".join(map(tok.token_bytes, ids)) == want.encode("utf-8")
        ids = tok.encode(text)
        for skip in (False, True):
            assert tok.decode_bytes(ids, skip) == oracle.detokenize(ids, skip, not skip)
    specials = [tok.token_id(t) for t in special_texts(tok)]
    for _ in range(300):  # arbitrary ids: specials, split multi-byte characters, BOS anywhere
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 10))]
        ids += [tok.bos_id, rng.choice(specials)]
        rng.shuffle(ids)
        for skip in (False, True):
            assert tok.decode_bytes(ids, skip) == oracle.detokenize(ids, skip, not skip), ids


def test_properties_match_llama_cpp(vocab):
    name, tok, oracle = vocab
    assert tok.vocab_size == oracle.n_vocab
    assert (tok.bos_id, tok.eos_id) == (oracle.bos, oracle.eos)
    assert set(tok.stop_ids) == {i for i in range(tok.vocab_size) if oracle.is_eog(i)}
    assert tok.add_bos == {"qwen2": False, "qwen35": False}.get(name, True)
    if name == "gemma-4":   # '</s>' is an ordinary token here, not an end of sequence
        assert tok.encode("</s>", add_bos=False) == oracle.tokenize("</s>") != \
            [tok.token_id("</s>")]


def test_gemma4_newline_runs_and_bos_without_merges_or_flag(tmp_path):
    """llama.cpp's two Gemma 4 rules that the shipped file does not need: a word of newlines
    that is a token is taken whole (here its merges are removed, as some converters leave
    them out), and BOS is added even where add_bos_token is false."""
    meta = gguf_metadata(str(vocab_file("gemma-4")))
    merges = [m for m in meta["tokenizer.ggml.merges"] if m.strip("\n ")]
    assert len(meta["tokenizer.ggml.merges"]) - len(merges) > 100
    path = write_vocab_gguf(tmp_path / "gemma4-no-newline-merges.gguf", model="gemma4",
                            tokens=meta["tokenizer.ggml.tokens"], merges=merges,
                            token_types=meta["tokenizer.ggml.token_type"], bos=2, eos=1,
                            add_bos=False)
    tok, oracle = load_tokenizer(path), LlamaVocab(path)
    assert tok.add_bos and oracle.tokenize("x", add_bos=True)[0] == tok.bos_id == 2
    texts = [f"a{chr(10) * n}b {chr(10) * (n // 2)}" for n in range(1, 70)]
    for text in texts:
        assert tok.encode(text) == oracle.tokenize(text, add_bos=True), repr(text)
    assert tok.encode("\n" * 31, add_bos=False) == [tok.token_id("\n" * 31)]
