"""Chat templates: SmolLM2's ChatML template rendered by kvcompile against llama.cpp's own
ChatML formatter, llama-cpp-python's Jinja formatter and a hand-built expected string."""
from __future__ import annotations

import ctypes

import llama_cpp
import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from kvcompile.errors import KvcompileError
from kvcompile.io.tokenizer import ChatTemplateError, Tokenizer
from tokenizer_oracle import gguf_metadata, LlamaVocab, fresh_rng

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return Tokenizer.from_metadata(gguf_metadata(str(smollm2_path)))


def chatml(messages, add_generation_prompt=True) -> str:
    """Expected ChatML, built by hand: one <|im_start|>role\\ncontent<|im_end|>\\n block per
    message, then the assistant header when a reply is wanted."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def llama_cpp_chatml(template: str, messages, add_generation_prompt=True) -> str:
    """llama.cpp's built-in formatter (it recognises SmolLM2's template as ChatML)."""
    arr = (llama_cpp.llama_chat_message * len(messages))(
        *[llama_cpp.llama_chat_message(role=m["role"].encode(), content=m["content"].encode())
          for m in messages])
    size = 4096
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(template.encode(), arr, len(messages),
                                                add_generation_prompt, buf, size)
        assert n >= 0, "llama.cpp did not recognise the template"
        if n <= size:
            return buf.raw[:n].decode()
        size = n + 1


def random_conversation(rng, n_turns: int, system: bool):
    words = ["lighthouse", "ship", "storm", "日本語", "привет", "café", "42", "🙂", "tab\there",
             "new\nline", "<b>", "'quoted'", "{{ not jinja }}", "{% raw %}", "end."]
    msgs = [{"role": "system", "content": "Be brief. " + rng.choice(words)}] if system else []
    for k in range(n_turns):
        role = "user" if k % 2 == 0 else "assistant"
        msgs.append({"role": role, "content": " ".join(rng.choice(words) for _ in range(rng.randint(1, 8)))})
    return msgs


def test_smollm2_multi_turn_equals_chatml(tok):
    rng = fresh_rng("chat")
    formatter = Jinja2ChatFormatter(tok.chat_template, eos_token="<|im_end|>", bos_token="<|im_start|>")
    for trial in range(20):
        with_system = trial % 2 == 0
        msgs = random_conversation(rng, rng.randint(1, 6), system=with_system)
        for gen in (True, False):
            ours = tok.apply_chat_template(msgs, add_generation_prompt=gen)
            full = msgs if with_system else [{"role": "system", "content": DEFAULT_SYSTEM}] + msgs
            assert ours == chatml(full, gen)
            formatter.add_generation_prompt = gen
            assert ours == formatter(messages=msgs).prompt
            if with_system:  # llama.cpp's built-in ChatML has no default system message
                assert ours == llama_cpp_chatml(tok.chat_template, msgs, gen)
    print("20 random conversations x 2: equal to hand-built ChatML, llama.cpp and llama-cpp-python")


def test_smollm2_fixed_conversation(tok):
    msgs = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "What is 2+2?"}]
    expected = ("<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n"
                "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
                "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs) == expected
    system = [{"role": "system", "content": "Answer in French."}] + msgs
    assert tok.apply_chat_template(system).startswith(
        "<|im_start|>system\nAnswer in French.<|im_end|>\n<|im_start|>user\nHi!")


def test_rendered_prompt_tokenizes_like_llama_cpp(tok, smollm2_path):
    oracle = LlamaVocab(smollm2_path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Count to three: 1, 2, 3?"}])
    ids = tok.encode(prompt)
    assert ids == oracle.tokenize(prompt, add_bos=True)
    im_start, im_end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2
    print(f"chat prompt: {len(ids)} tokens")


@pytest.mark.parametrize("messages, needle", [
    ([{"content": "no role"}], "role None; a role is one of"),
    ([{"role": "user"}], "no 'content'"),
    ([{"role": "", "content": "x"}], "role ''"),
    ([{"role": "wizard", "content": "x"}], "role 'wizard'; a role is one of 'system'"),
    ([{"role": "user", "content": 5}], "content of type int"),
    (["just a string"], "not a dict"),
    ("hello", "must be a list"),
    ([], "empty"),
])
def test_malformed_messages_raise(tok, messages, needle):
    with pytest.raises(ChatTemplateError, match=needle) as info:
        tok.apply_chat_template(messages)
    assert isinstance(info.value, KvcompileError)
    print(info.value)


def test_template_problems_raise(tok):
    msgs = [{"role": "user", "content": "hi"}]
    no_template = Tokenizer.from_metadata({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "a"],
        "tokenizer.ggml.token_type": [2, 3, 3, 1], "tokenizer.ggml.scores": [0.0] * 4})
    with pytest.raises(ChatTemplateError, match="no chat template"):
        no_template.apply_chat_template(msgs)
    # the same tokenizer works once a template is given explicitly
    assert no_template.apply_chat_template(msgs, template="{{ bos_token }}{{ messages[0].content }}") == "<s>hi"
    with pytest.raises(ChatTemplateError, match="only user"):
        tok.apply_chat_template(msgs, template="{{ raise_exception('only user turns allowed') }}")
    with pytest.raises(ChatTemplateError, match="does not parse"):
        tok.apply_chat_template(msgs, template="{% for m in messages %}")
    with pytest.raises(ChatTemplateError):  # the sandbox refuses attribute escapes
        tok.apply_chat_template(msgs, template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):  # and mutation of the caller's data
        tok.apply_chat_template(msgs, template="{{ messages.append(1) }}")
    assert tok.apply_chat_template(
        msgs, template="{{ messages | tojson }}{{ eos_token }}") == '[{"role": "user", "content": "hi"}]<|im_end|>'


# Gemma 3's chat format (its tokenizer_config's template, in the same logic): a system message
# joins the first user turn, the assistant is "model", contents trimmed, BOS first
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")


def test_gemma3_template_renders_as_llama_cpp():
    """Gemma 3's template through kvcompile's Jinja renderer equals llama.cpp's built-in
    Gemma formatter (which it picks by the template's <start_of_turn>; it writes no BOS)."""
    from kvcompile.io.tokenizer.chat import render_chat_template
    rng = fresh_rng("gemma3 chat")
    for trial in range(20):
        # llama.cpp trims the system message too; Gemma's template keeps it as written
        msgs = [m if m["role"] != "system" else dict(m, content=m["content"].strip())
                for m in random_conversation(rng, 1 + 2 * rng.randint(0, 3), trial % 2 == 0)]
        for gen in (True, False):
            ours = render_chat_template(GEMMA3_TEMPLATE, msgs, add_generation_prompt=gen,
                                        bos_token="<bos>")
            assert ours == "<bos>" + llama_cpp_chatml(GEMMA3_TEMPLATE, msgs, gen), msgs
    with pytest.raises(ChatTemplateError, match="alternate"):
        render_chat_template(GEMMA3_TEMPLATE, [{"role": "assistant", "content": "hi"}])
