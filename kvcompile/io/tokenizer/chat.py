"""Chat templates: render `tokenizer.chat_template` (Jinja) for a list of messages.

The template runs in Jinja's immutable sandbox with the settings Hugging Face uses for chat
templates (trim_blocks, lstrip_blocks, loop controls, `{% generation %}` blocks), plus the
helpers templates expect: `raise_exception`, `strftime_now` and a `tojson` that keeps
non-ASCII text as is.
A model without a template is an error (no silent fallback: a wrong format degrades
answers without any visible failure); pass `template=` to supply one.
"""
from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvcompile.io.tokenizer.errors import ChatTemplateError


def _raise_exception(message: str):
    raise ChatTemplateError(f"the chat template rejected the messages: {message}")


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (Hugging Face's marker for assistant text in
    training masks) renders its body unchanged."""
    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"the chat template does not parse (line {exc.lineno}: {exc.message}); fix the "
            f"template or pass another one with template=...") from None


# the roles chat templates know (OpenAI's, with "developer" for "system" in newer clients)
ROLES = ("system", "developer", "user", "assistant", "tool")


def validate_messages(messages) -> list[dict]:
    """Each message needs a 'role' of ROLES and a 'content' that is a string (or a
    list of content parts, or None for an assistant message that only carries tool calls)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got "
            f"{type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages is empty; pass at least one {'role': 'user', "
                                "'content': ...} message")
    for k, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ChatTemplateError(f"message {k} is a {type(msg).__name__}, not a dict with "
                                    f"'role' and 'content'")
        role = msg.get("role")
        if role not in ROLES:
            raise ChatTemplateError(f"message {k} has role {role!r}; a role is one of "
                                    f"{', '.join(map(repr, ROLES))}")
        if "content" not in msg:
            raise ChatTemplateError(f"message {k} ({role}) has no 'content'; add the message "
                                    f"text as 'content'")
        content = msg["content"]
        ok = (isinstance(content, str) or (isinstance(content, list) and content)
              or (content is None and msg.get("tool_calls")))
        if not ok:
            raise ChatTemplateError(f"message {k} ({role}) has content of type "
                                    f"{type(content).__name__}; it must be a string")
    return [dict(m) for m in messages]


def render_chat_template(template: str | None, messages, *, add_generation_prompt: bool = True,
                         bos_token: str = "", eos_token: str = "", **extra) -> str:
    if not template:
        raise ChatTemplateError(
            "this model has no chat template (tokenizer.chat_template is missing); pass a "
            "Jinja template with template=..., or send a plain text prompt instead of messages")
    compiled = _compile(template)
    msgs = validate_messages(messages)
    try:
        return compiled.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, **extra)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(
            f"the chat template failed on these messages ({type(exc).__name__}: {exc}); check "
            f"the message roles/order the template expects") from None
