"""URL and key resolution, and non-2xx answers becoming typed exceptions."""

from __future__ import annotations

import email.utils
import time

import httpx
import pytest

import scalarlm
from scalarlm.client import AsyncScalarLM, ScalarLM
from scalarlm.client.connection import error_for, parse_retry_after, resolve_api_key, resolve_api_url
from scalarlm.protocol.errors import (
    EngineUnavailable,
    InvalidRequest,
    NotFound,
    QueueFull,
    ScalarLMError,
    Unauthorized,
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("SCALARLM_API_URL", "MASINT_API_URL", "SCALARLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(scalarlm, "api_url", None)
    return monkeypatch


def test_url_order_argument_module_env_default(clean_env: pytest.MonkeyPatch) -> None:
    assert resolve_api_url() == "http://localhost:8000"
    clean_env.setenv("MASINT_API_URL", "http://masint:1")
    assert resolve_api_url() == "http://masint:1"
    clean_env.setenv("SCALARLM_API_URL", "http://env:2/")
    assert resolve_api_url() == "http://env:2"
    clean_env.setattr(scalarlm, "api_url", "http://module:3")
    assert resolve_api_url() == "http://module:3"
    assert resolve_api_url("http://arg:4/") == "http://arg:4"
    assert ScalarLM().api_url == "http://module:3"
    assert AsyncScalarLM("http://arg:5").api_url == "http://arg:5"


def test_api_key_from_argument_or_env(clean_env: pytest.MonkeyPatch) -> None:
    assert resolve_api_key() is None
    clean_env.setenv("SCALARLM_API_KEY", "from-env")
    assert resolve_api_key() == "from-env"
    assert resolve_api_key("explicit") == "explicit"


def _error(status: int, body: object = None, text: str | None = None, headers: dict | None = None) -> ScalarLMError:
    if text is not None:
        response = httpx.Response(status, text=text, headers=headers)
    else:
        response = httpx.Response(status, json=body, headers=headers)
    return error_for(response)


def test_error_bodies_map_to_typed_exceptions() -> None:
    body = {"error": {"message": "model 'x' not found", "type": "not_found_error", "param": "model", "code": 404}}
    exc = _error(404, body)
    assert isinstance(exc, NotFound) and exc.message == "model 'x' not found" and exc.param == "model"
    assert isinstance(_error(400, {"error": {"message": "bad", "type": "invalid_request_error", "code": 400}}),
                      InvalidRequest)
    assert isinstance(_error(401, {"error": {"message": "no key", "type": "authentication_error", "code": 401}}),
                      Unauthorized)
    assert isinstance(_error(503, text="engine starting"), EngineUnavailable)
    odd = _error(502, text="bad gateway")
    assert type(odd) is ScalarLMError and odd.status_code == 502 and "bad gateway" in odd.message


def test_retry_after_seconds_and_http_date() -> None:
    exc = _error(429, {"error": {"message": "busy", "type": "rate_limit_error", "code": 429}},
                 headers={"Retry-After": "3"})
    assert isinstance(exc, QueueFull) and exc.retry_after == 3.0
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 20 <= parse_retry_after(later) <= 31
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None
