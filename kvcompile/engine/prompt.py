"""A request's prompt as token ids: a string, chat messages (through the model's chat
template) or token ids, each checked before anything runs."""
from __future__ import annotations

from kvcompile.errors import KvcompileError


def encode_prompt(tokenizer, vocab_size: int, prompt, messages) -> list[int]:
    if (prompt is None) == (messages is None):
        raise KvcompileError("pass either a prompt string or chat messages, not both or neither")
    if messages is not None:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    elif isinstance(prompt, (list, tuple)):           # token ids, as they are
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in prompt):
            raise KvcompileError(f"a prompt of token ids takes ints in [0, {vocab_size}) "
                                 f"(this model's vocabulary)")
        if not prompt:
            raise KvcompileError("the prompt is empty; give at least one token")
        return list(prompt)
    elif not isinstance(prompt, str):
        raise KvcompileError(f"prompt must be a string or a list of token ids, got "
                             f"{type(prompt).__name__}")
    ids = tokenizer.encode(prompt)
    if not ids:
        raise KvcompileError("the prompt is empty; give at least one token of text")
    return ids
