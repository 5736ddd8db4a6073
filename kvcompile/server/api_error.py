"""Errors as OpenAI's API gives them: a status code and a JSON body
{"error": {"message", "type", "param", "code"}}; every one leaves the server serving."""
from __future__ import annotations

from kvcompile.errors import ContextLengthError, KvcompileError, SessionError


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400: the request itself is wrong."""
    return ApiError(400, message, param=param, code=code)


def from_request_error(e: KvcompileError, prompt_param: str | None = None) -> ApiError:
    """An Engine's refusal of a request (raised before anything ran): a 400."""
    if isinstance(e, ContextLengthError):
        return invalid(str(e), param=prompt_param, code="context_length_exceeded")
    if isinstance(e, SessionError):
        return invalid(str(e), param="filename", code="invalid_session")
    return invalid(str(e))


def internal(e: BaseException) -> ApiError:
    """A failure while the request ran: a 500 (the Engine serves the next request)."""
    return ApiError(500, f"the request failed while it ran: {type(e).__name__}: {e}",
                    type="server_error", code="internal_error")


def model_not_found(name: str, served: list[str]) -> ApiError:
    return ApiError(404, f"The model `{name}` does not exist; this server serves "
                         f"{', '.join(served)} (GET /v1/models)",
                    param="model", code="model_not_found")


def queue_full(size: int, retry_after_s: int = 1) -> ApiError:
    return ApiError(503, f"the server is busy: {size} request(s) already wait for the model; "
                         f"retry later", type="server_error", code="queue_full",
                    headers={"Retry-After": str(retry_after_s)})
