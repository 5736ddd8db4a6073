"""OpenAI's response shapes: chat.completion / text_completion bodies, their streamed
chunks, `usage`, and server-sent events."""
from __future__ import annotations

import json
import time
import uuid

# the Engine's finish reasons that OpenAI's clients do not know
FINISH = {"context": "length", "cancelled": "stop"}


def usage(result) -> dict:
    return {"prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


def timings(result) -> dict:
    """llama.cpp's server `timings`: the Engine's prefill (to the first token) and decode."""
    prefilled = result.prompt_tokens - result.cached_tokens
    return {"cache_n": result.cached_tokens, "prompt_n": prefilled,
            "prompt_ms": 1e3 * result.prefill_s, "prompt_per_second": result.prefill_tok_s,
            "predicted_n": result.completion_tokens, "predicted_ms": 1e3 * result.decode_s,
            "predicted_per_second": result.decode_tok_s}


def sse(data) -> str:
    """One server-sent event: `data: <json>` (or the text as it is), a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class Shapes:
    """The bodies of one response: chat (chat.completion) or text (text_completion)."""

    def __init__(self, chat: bool, model: str, return_tokens: bool = False):
        self.chat, self.model, self.return_tokens = chat, model, return_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, object: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices, **extra}

    def body(self, result) -> dict:
        """The whole (not streamed) response."""
        finish = FINISH.get(result.finish_reason, result.finish_reason)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                      "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None,
                      "finish_reason": finish}
        if self.return_tokens:
            choice["tokens"] = result.token_ids
        return self._envelope("chat.completion" if self.chat else "text_completion", [choice],
                              usage=usage(result), timings=timings(result))

    def chunk(self, text: str | None = None, finish: str | None = None, *,
              first: bool = False) -> dict:
        """A streamed chunk: text, or the last one (finish set, no text)."""
        if finish is not None:
            finish = FINISH.get(finish, finish)
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else \
                ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, result) -> dict:
        """After the last chunk when stream_options.include_usage: no choices, the usage."""
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [],
                              usage=usage(result), timings=timings(result))
