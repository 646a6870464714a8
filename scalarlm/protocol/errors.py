"""Typed errors shared by server and client, and the one wire shape they travel in.

Core code raises these; `server/errors.py` turns them into `ErrorResponse` with their status code;
the client turns an `ErrorResponse` back into the same exception class.
"""

from __future__ import annotations

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""

    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """Every non-2xx JSON answer of the server has this shape."""

    error: ErrorDetail


class ScalarLMError(Exception):
    """Base of every error scalarlm raises on purpose."""

    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorDetail(message=self.message, type=self.error_type, param=self.param, code=self.status_code)
        )


class InvalidRequest(ScalarLMError):
    status_code = 400
    error_type = "invalid_request_error"


class Unauthorized(ScalarLMError):
    status_code = 401
    error_type = "authentication_error"


class Forbidden(ScalarLMError):
    status_code = 403
    error_type = "permission_error"


class NotFound(ScalarLMError):
    status_code = 404
    error_type = "not_found_error"


class Conflict(ScalarLMError):
    status_code = 409
    error_type = "conflict_error"


class PayloadTooLarge(ScalarLMError):
    status_code = 413
    error_type = "payload_too_large"


class ChecksumMismatch(ScalarLMError):
    """An uploaded chunk or file does not match its declared SHA-256 (the ScalarLM SDK retries on 422)."""

    status_code = 422
    error_type = "checksum_mismatch"


class QueueFull(ScalarLMError):
    """Beyond capacity: try again after `retry_after` seconds."""

    status_code = 429
    error_type = "rate_limit_error"


class EngineUnavailable(ScalarLMError):
    status_code = 503
    error_type = "engine_unavailable"


class ModelLoadFailed(ScalarLMError):
    """A listed model whose published weights a worker could not load (a broken or deleted checkpoint).

    500, not 404: the model exists, its files are the problem; the message names the model, version and why.
    """

    status_code = 500
    error_type = "model_load_error"


ERRORS_BY_STATUS: dict[int, type[ScalarLMError]] = {
    cls.status_code: cls
    for cls in (
        InvalidRequest, Unauthorized, Forbidden, NotFound, Conflict, PayloadTooLarge, ChecksumMismatch, QueueFull,
        EngineUnavailable,
    )  # fmt: skip
}


def error_from_response(status_code: int, body: object, retry_after: float | None = None) -> ScalarLMError:
    """Rebuild the typed exception for a non-2xx answer (used by the client)."""
    cls = ERRORS_BY_STATUS.get(status_code, ScalarLMError)
    message = f"HTTP {status_code}"
    param = None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            message = str(err.get("message", message))
            param = err.get("param")
        elif "detail" in body:  # FastAPI's own 422 shape, should it ever slip through
            message = str(body["detail"])
    elif isinstance(body, str) and body:
        message = body
    exc = cls(message, param=param, retry_after=retry_after)
    exc.status_code = status_code
    return exc
