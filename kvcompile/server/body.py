"""A request's JSON body, read up to a size limit (over it: 413), decoded as UTF-8 (else
400) and parsed (bad JSON: 400)."""
from __future__ import annotations

import json

from kvcompile.server.api_error import ApiError, invalid

DRAIN_FACTOR = 16     # an oversized body is read (and dropped) up to this many limits, so
# the client, still sending, reads the 413 instead of a reset connection


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over the server's limit of {limit} bytes "
                         f"(--max-body-mib)", code="request_too_large")


async def read_body(request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit * DRAIN_FACTOR:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif size > limit * DRAIN_FACTOR:
            break
    if size > limit:
        raise too_large(limit)
    return b"".join(chunks)


async def read_json(request, limit: int):
    raw = await read_body(request, limit)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"the request body is not UTF-8 (byte {e.start})",
                      code="invalid_encoding") from None
    if not text.strip():
        raise invalid("the request body is empty; send a JSON object", code="invalid_json")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise invalid(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise invalid("the request body nests too deeply", code="invalid_json") from None
