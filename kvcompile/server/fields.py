"""A request body's fields, type-checked (wrong types: 400), as one GenRequest.

Unknown fields are ignored, as OpenAI's server ignores them; a null field counts as absent.
Ranges (temperature >= 0, top_p in (0, 1], ...) and the prompt's length are the Engine's
checks (SamplingError, ContextLengthError: 400 too); here only what the Engine cannot see:
the JSON types, n = 1, max_tokens within the context, the messages' shape.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvcompile.server.api_error import invalid

# JSON type name -> test of a decoded value (a bool is no number here)
_KINDS = {
    "a number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "an integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "a boolean": lambda v: isinstance(v, bool),
    "a string": lambda v: isinstance(v, str),
    "an object": lambda v: isinstance(v, dict),
    "an array": lambda v: isinstance(v, list),
}
# request field -> (Engine option, JSON type)
SAMPLING = {
    "temperature": ("temperature", "a number"), "top_p": ("top_p", "a number"),
    "top_k": ("top_k", "an integer"), "min_p": ("min_p", "a number"),
    "seed": ("seed", "an integer"), "repeat_penalty": ("repeat_penalty", "a number"),
    "repeat_last_n": ("repeat_last_n", "an integer"),
}


@dataclass
class GenRequest:
    chat: bool
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    options: dict = field(default_factory=dict)     # engine.stream's keyword options
    stream: bool = False
    include_usage: bool = False
    cache_prompt: bool = True
    return_tokens: bool = False                     # the choice's token ids (llama.cpp's)
    model: str | None = None


def typed(body: dict, name: str, kind: str):
    """body[name] if it is of the JSON type `kind`; None if absent or null; else a 400."""
    value = body.get(name)
    if value is None or _KINDS[kind](value):
        return value
    raise invalid(f"{name} must be {kind}, got {_json_type(value)}", param=name,
                  code="invalid_type")


def _json_type(value) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "an array", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def parse_request(body, *, chat: bool, ctx_size: int, default_max_tokens: int,
                  cache_prompt: bool) -> GenRequest:
    """The fields of a /v1/chat/completions (chat) or /v1/completions body."""
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {_json_type(body)}")
    req = GenRequest(chat=chat, model=typed(body, "model", "a string"))
    if chat:
        req.messages = _messages(body)
    else:
        req.prompt = _prompt(body)
    n = typed(body, "n", "an integer")
    if n is not None and n != 1:
        raise invalid(f"n must be 1: this server generates one choice a request, got {n}",
                      param="n", code="unsupported_value")
    req.options = _sampling(body, ctx_size, default_max_tokens)
    req.stream = bool(typed(body, "stream", "a boolean"))
    stream_options = typed(body, "stream_options", "an object") or {}
    req.include_usage = bool(typed(stream_options, "include_usage", "a boolean"))
    flag = typed(body, "cache_prompt", "a boolean")
    req.cache_prompt = cache_prompt if flag is None else flag
    req.return_tokens = bool(typed(body, "return_tokens", "a boolean"))
    return req


def _sampling(body: dict, ctx_size: int, default_max_tokens: int) -> dict:
    options = {}
    for name, (option, kind) in SAMPLING.items():
        value = typed(body, name, kind)
        if value is not None:
            options[option] = value
    # chat: max_completion_tokens (OpenAI's newer name) first
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = typed(body, name, "an integer")
    if max_tokens is None:
        max_tokens = ctx_size if default_max_tokens < 0 else default_max_tokens
    elif not 0 <= max_tokens <= ctx_size:
        raise invalid(f"{name} must be in [0, {ctx_size}] (the context holds {ctx_size} "
                      f"tokens, the prompt included), got {max_tokens}", param=name,
                      code="invalid_value")
    options["max_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise invalid("stop must be a string or an array of strings", param="stop",
                          code="invalid_type")
        options["stop"] = tuple(s for s in stop if s)
    return options


def _messages(body: dict) -> list[dict]:
    messages = typed(body, "messages", "an array")
    if not messages:
        raise invalid("messages must be a non-empty array of {role, content} objects",
                      param="messages", code="invalid_value")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"{where} must be an object, got {_json_type(m)}", param=where,
                          code="invalid_type")
        role = typed(m, "role", "a string")
        if not role:
            raise invalid(f"{where}.role must be a non-empty string", param=f"{where}.role",
                          code="invalid_value")
        out.append({"role": role, "content": _content(m.get("content"), f"{where}.content")})
    return out


def _content(content, where: str) -> str:
    """A message's content: a string, or an array of text parts (joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    raise invalid(f"{where} must be a string or an array of text parts "
                  f"({{\"type\": \"text\", \"text\": ...}}; this server reads text only)",
                  param=where, code="invalid_type")


def _prompt(body: dict):
    """A completion's prompt: a string or token ids (or an array of one of them)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(_KINDS["an integer"](t) for t in prompt):
        return prompt
    if prompt is None:
        raise invalid("prompt is required: a string or an array of token ids", param="prompt",
                      code="missing_field")
    raise invalid("prompt must be a string or a non-empty array of token ids (one prompt a "
                  "request)", param="prompt", code="invalid_type")
