"""Where the client connects and how a non-2xx answer becomes a typed exception.

The client is a separate installable, so it resolves its own URL and key (argument, then the
`scalarlm.api_url` module attribute, then environment, then localhost) the way ScalarLM's SDK does.
"""

from __future__ import annotations

import email.utils
import os
import sys
import time

import httpx

from scalarlm.protocol.errors import ScalarLMError, error_from_response

DEFAULT_API_URL = "http://localhost:8000"
# Seconds per request, beyond the long-poll window a call asks for.
DEFAULT_TIMEOUT = 60.0
URL_ENV_NAMES = ("SCALARLM_API_URL", "MASINT_API_URL")
KEY_ENV_NAME = "SCALARLM_API_KEY"


def resolve_api_url(api_url: str | None = None) -> str:
    """The server URL: argument, `scalarlm.api_url`, $SCALARLM_API_URL, $MASINT_API_URL, localhost."""
    if api_url:
        return api_url.rstrip("/")
    package = sys.modules.get("scalarlm")
    module_url = getattr(package, "api_url", None)
    if module_url:
        return str(module_url).rstrip("/")
    for name in URL_ENV_NAMES:
        if os.environ.get(name):
            return os.environ[name].rstrip("/")
    return DEFAULT_API_URL


def resolve_api_key(api_key: str | None = None) -> str | None:
    """The API key: argument, then $SCALARLM_API_KEY; None sends no Authorization header."""
    return api_key or os.environ.get(KEY_ENV_NAME) or None


def auth_headers(api_key: str | None) -> dict[str, str]:
    """Headers every request carries."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def error_for(response: httpx.Response) -> ScalarLMError:
    """The typed exception for a non-2xx response (its body must already be read)."""
    try:
        body: object = response.json()
    except ValueError:
        body = response.text
    return error_from_response(
        response.status_code, body, retry_after=parse_retry_after(response.headers.get("retry-after"))
    )


def decode(response: httpx.Response) -> object:
    """The JSON body of a 2xx response; raise the typed error for anything else."""
    if response.is_success:
        if "json" not in response.headers.get("content-type", "json"):
            return response.text  # plain-text routes (a job's logs)
        return response.json()
    raise error_for(response)
