"""Helpers for the tokenizer tests: llama.cpp (through llama-cpp-python) as the oracle,
vocab-only GGUF writing with the gguf package, and fresh random test text."""
from __future__ import annotations

import ctypes
import functools
import os
import random
from pathlib import Path

import gguf
import llama_cpp

from kvcompile.io.gguf.reader import GgufFile

CORPUS = Path(__file__).parent / "data" / "tokenizer_mixed.txt"


@functools.lru_cache(maxsize=2)
def gguf_metadata(path: str) -> dict:
    """A model's metadata, parsed once per test session (49k-entry arrays parse slowly)."""
    return GgufFile(path).metadata


def read_corpus() -> str:
    with open(CORPUS, encoding="utf-8", newline="") as f:  # keep \r\n and lone \r as written
        return f.read()


class LlamaVocab:
    """llama.cpp's tokenizer for one GGUF (vocab_only: no weights are loaded)."""

    def __init__(self, path: str | os.PathLike):
        self.llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        self.vocab = self.llm._model.vocab

    def tokenize(self, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)

    def detokenize(self, ids: list[int], remove_special: bool, unparse_special: bool) -> bytes:
        arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
        size = 64 + 16 * len(ids)
        while True:
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_detokenize(self.vocab, arr, len(ids), buf, size,
                                           remove_special, unparse_special)
            if n >= 0:
                return buf.raw[:n]
            size = -n + 1

    def is_eog(self, token_id: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token_id))

    @property
    def n_vocab(self) -> int:
        return llama_cpp.llama_vocab_n_tokens(self.vocab)

    @property
    def bos(self) -> int:
        return llama_cpp.llama_vocab_bos(self.vocab)

    @property
    def eos(self) -> int:
        return llama_cpp.llama_vocab_eos(self.vocab)


def write_vocab_gguf(path: str | os.PathLike, *, model: str, tokens: list[str],
                     token_types: list[int], merges: list[str] | None = None,
                     scores: list[float] | None = None, pre: str | None = None,
                     bos: int | None = None, eos: int | None = None,
                     add_bos: bool | None = None, add_eos: bool | None = None,
                     add_space_prefix: bool | None = None,
                     chat_template: str | None = None) -> Path:
    """A tensor-less llama-architecture GGUF that llama.cpp opens with vocab_only=True."""
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_context_length(4096)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


# pieces that stress pre-tokenizers: contractions, special-token texts, unusual whitespace
_TRICKY = ["'s", "'S", "'re", "'RE", "'ll", "'d", "'", " '", "<|im_start|>", "<|im_end|>",
           "<|endoftext|>", "<|im_end", "<|", "|>", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r",
           "\u00a0", "\u3000", "\u2028", "\x85", "\x0b", "\x0c", " \n", "123", "4567", "-", "...",
           "\u0301", "\u200d", "\U0001F44D\U0001F3FD", "\u00e9", "e\u0301"]
_RANGES = [(0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x3FF), (0x400, 0x4FF),
           (0x590, 0x6FF), (0x900, 0x97F), (0xE00, 0xE7F), (0x2000, 0x206F), (0x2100, 0x22FF),
           (0x3000, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0xFF00, 0xFFEF),
           (0x1F300, 0x1FAFF), (0x10000, 0x3134F)]


def fresh_rng(tag: str) -> random.Random:
    """A new random seed every run, printed so that a failure can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"[{tag}] random seed {seed}")
    return random.Random(seed)


def random_text(rng: random.Random, corpus: str, n_chars: int) -> str:
    out: list[str] = []
    while sum(map(len, out)) < n_chars:
        r = rng.random()
        if r < 0.3:
            start = rng.randrange(len(corpus))
            out.append(corpus[start:start + rng.randint(1, 40)])
        elif r < 0.55:
            out.append(rng.choice(_TRICKY))
        else:
            lo, hi = rng.choice(_RANGES)
            cp = rng.randint(lo, hi)
            if 0xD800 <= cp <= 0xDFFF:
                cp = 0x41
            out.append(chr(cp))
    return "".join(out)


def random_chunks(rng: random.Random, text: str, n: int, max_len: int = 300) -> list[str]:
    chunks = []
    for _ in range(n):
        start = rng.randrange(len(text))
        chunks.append(text[start:start + rng.randint(1, max_len)])
    return chunks


# Material for mixed_text: each entry draws one piece from a random generator.
_WORDS = ("the of and to in is it that was for on are with as his they be at one have this "
          "from or had by word but what some we can out other were all there when up use your "
          "how said an each she which do their time if will way about many then them would "
          "write like so these her long make thing see him two has look more day could go come "
          "did number sound no most people my over know water than call first who may down "
          "don't it's we're they'll I'd you've she's Hello World HTTP JSON kvcompile").split()
_ACCENTED = ["café", "naïve", "résumé", "Ångström", "façade", "jalapeño", "über", "Ærøskøbing",
             "Dvořák", "Łódź", "São Paulo", "Nguyễn", "crème brûlée", "e\u0301te\u0301",
             "Zo\u00eb", "Mu\u0308nchen", "ﬁne", "Ⅻ", "ǅ", "ΑΒΓ δέλτα", "Привет мир", "Ελλάδα"]
_CJK = ["我想在苹果公司工作", "東京は日本の首都です。", "한국어 문장입니다", "これはテストです",
        "中文，标点！“引号”", "ｆｕｌｌｗｉｄｔｈ　ｔｅｘｔ", "汉字と仮名とハングル", "第３章　結論"]
_EMOJI = ["\U0001F600", "\U0001F44D\U0001F3FD", "\U0001F468\u200D\U0001F469\u200D\U0001F467",
          "\U0001F1EB\U0001F1F7", "\u2764\ufe0f", "\U0001F999", "\U0001F680\U0001F680",
          "\u2705", "\U0001F636\u200D\U0001F32B\ufe0f", "\U0001F9D1\U0001F3FF\u200D\U0001F4BB"]
_OTHER_SCRIPTS = ["नमस्ते दुनिया", "مرحبا بالعالم", "שלום עולם", "สวัสดีครับ",
                  "កាន់តែពិសេស", "ሰላም ልዑል", "Tiếng Việt", "ᚠᚢᚦᚨᚱᚲ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "𓀀𓀁"]
_CODE = [
    "def f(x: int) -> int:\n    return x ** 2 + 1\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    "const re = /^[a-z0-9_-]{3,16}$/i; // usernames\n",
    "SELECT id, name FROM users WHERE age >= 21 ORDER BY name DESC;\n",
    "<div class=\"row\"><span>&nbsp;&lt;tag&gt;</span></div>\n",
    "{\"key\": [1, 2.5, -3e-7, null, true], \"nested\": {\"a\": \"b\"}}\n",
    "if [[ -f \"$HOME/.bashrc\" ]]; then source ~/.bashrc; fi\n",
    "fn main() { println!(\"{:?}\", vec![1u8, 2, 3]); }\n",
    "x = lambda *args, **kw: (args, kw)  # noqa: E731\n",
    "#include <stdio.h>\nint main(void){printf(\"%d\\n\",42);}\n",
]
_SPACES = [" ", "  ", "   ", "    ", "        ", "\t", "\t\t", " \t ", "\n", "\n\n", "\n\n\n\n",
           "\r\n", "\r\n\r\n", "\r", " \n ", "\u00a0", "\u3000", "\u2003", "\u2028", "\x0b", "\x0c",
           " " * 17, "\n" * 9, "\t\n\t"]


def _number(rng: random.Random) -> str:
    kind = rng.randrange(7)
    if kind == 0:
        return str(rng.randrange(10 ** rng.randint(1, 12)))
    if kind == 1:
        return f"{rng.uniform(-1e4, 1e4):.{rng.randint(0, 6)}f}"
    if kind == 2:
        return f"{rng.randrange(10 ** 9):,}"
    if kind == 3:
        return f"{rng.random():.3e}"
    if kind == 4:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(13, 40)))
    if kind == 5:
        return f"0x{rng.randrange(1 << 32):08X}"
    return rng.choice(["１２３", "٣٤٥", "१२३", "½", "²³", "Ⅻ", "①②"])


def mixed_text(rng: random.Random, min_bytes: int, corpus: str = "") -> str:
    """Fresh text of at least min_bytes UTF-8 bytes: English words, accents (precomposed and
    combining), CJK, other scripts, emoji sequences, numbers in many shapes, code, runs of
    spaces / tabs / newlines, and (if given) snippets of the corpus, in random order."""
    draws = [
        lambda: " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 12))),
        lambda: rng.choice(_ACCENTED), lambda: rng.choice(_CJK), lambda: rng.choice(_EMOJI),
        lambda: rng.choice(_OTHER_SCRIPTS), lambda: _number(rng), lambda: rng.choice(_CODE),
        lambda: rng.choice(_SPACES), lambda: rng.choice(_SPACES), lambda: rng.choice(_TRICKY),
        lambda: random_text(rng, corpus or "x", rng.randint(1, 6)),
    ]
    if corpus:
        draws.append(lambda: random_chunks(rng, corpus, 1, 120)[0])
    out: list[str] = []
    size = 0
    while size < min_bytes:
        piece = rng.choice(draws)()
        if rng.random() < 0.5:
            piece += rng.choice(" \n.,;:!?")
        out.append(piece)
        size += len(piece.encode("utf-8"))
    return "".join(out)
