"""The one place where errors become HTTP answers: every non-2xx body is an `ErrorResponse`.

Typed `ScalarLMError`s keep their status code (QueueFull adds `Retry-After`); request validation
failures (bad types, malformed JSON, missing fields) become 400 with a message naming the field,
as vLLM answers; Starlette's own HTTP errors (unknown route, 413 from the body limit) keep their
status but take the same shape.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from scalarlm.protocol.errors import ERRORS_BY_STATUS, ErrorDetail, ErrorResponse, ScalarLMError

logger = logging.getLogger(__name__)


def error_response(exc: ScalarLMError) -> JSONResponse:
    """The JSON answer for a typed error, with `Retry-After` when it says when to retry."""
    headers = {}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return JSONResponse(exc.to_response().model_dump(), status_code=exc.status_code, headers=headers)


# Location parts pydantic adds for union members; they name types, not fields the client sent.
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_name(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc if p != "body" and str(p) not in _UNION_TAGS and "[" not in str(p)]
    return ".".join(parts) or "body"


def describe_validation(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A readable message naming the offending field(s), and the first field's dotted name."""
    by_field: dict[str, list[str]] = {}
    for err in errors:
        if err.get("type") == "json_invalid":
            reason = err.get("ctx", {}).get("error", "parse error")
            by_field.setdefault("body", []).append(f"request body is not valid JSON ({reason})")
            continue
        msgs = by_field.setdefault(_field_name(err.get("loc", ())), [])
        if err.get("msg") not in msgs:
            msgs.append(str(err.get("msg", "invalid value")))
    parts = [
        msgs[0] if field == "body" and msgs[0].startswith("request body") else f"{field}: {' or '.join(msgs)}"
        for field, msgs in list(by_field.items())[:5]
    ]
    if len(by_field) > 5:
        parts.append(f"... and {len(by_field) - 5} more fields")
    return "; ".join(parts) or "invalid request", next(iter(by_field), None)


async def _on_scalarlm_error(request: Request, exc: ScalarLMError) -> JSONResponse:
    if exc.status_code >= 500:
        logger.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status_code, exc.message)
    return error_response(exc)


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = describe_validation(list(exc.errors()))
    content_type = request.headers.get("content-type", "")
    if param == "body" and "json" not in content_type:
        # FastAPI parses JSON only when declared (a CSRF guard); say so instead of "not an object".
        message = f"the body must be a JSON object sent with Content-Type: application/json (got {content_type!r})"
    body = ErrorResponse(error=ErrorDetail(message=message, type="invalid_request_error", param=param, code=400))
    return JSONResponse(body.model_dump(), status_code=400)


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    cls = ERRORS_BY_STATUS.get(exc.status_code)
    kind = cls.error_type if cls is not None else "http_error"
    body = ErrorResponse(error=ErrorDetail(message=str(exc.detail), type=kind, code=exc.status_code))
    return JSONResponse(body.model_dump(), status_code=exc.status_code, headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Register the error map on an app."""
    app.add_exception_handler(ScalarLMError, _on_scalarlm_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _on_http_error)  # type: ignore[arg-type]
