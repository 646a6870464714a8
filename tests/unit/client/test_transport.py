"""Result polls survive dropped connections and gateway errors; submissions are never sent twice."""

from __future__ import annotations

import httpx
import pytest

from scalarlm.client import flows, transport


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport, "FIRST_BACKOFF_SECONDS", 0.0)


def flaky(failures: list[object]) -> tuple[httpx.MockTransport, list[str]]:
    """A transport that fails with each of `failures` in turn, then answers one finished result."""
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if failures:
            failure = failures.pop(0)
            if isinstance(failure, int):
                return httpx.Response(failure, text="gateway")
            raise failure  # type: ignore[misc]
        return httpx.Response(200, json={"results": [{"request_id": "a", "response": "A", "status": "completed"}]})

    return httpx.MockTransport(handle), seen


def test_sync_poll_retries_transport_and_gateway_errors() -> None:
    mock, seen = flaky([httpx.ConnectError("refused"), 502, httpx.ReadError("reset")])
    with httpx.Client(transport=mock, base_url="http://server") as http:
        [result] = transport.run_sync(http, flows.get_results(["a"], 1.0))
    assert result.response == "A" and len(seen) == 4


async def test_async_poll_retries() -> None:
    mock, seen = flaky([httpx.ConnectError("refused"), 504])
    async with httpx.AsyncClient(transport=mock, base_url="http://server") as http:
        [result] = await transport.run_async(http, flows.get_results(["a"], 1.0))
    assert result.response == "A" and len(seen) == 3


def test_submission_is_not_resent() -> None:
    mock, seen = flaky([httpx.ReadError("reset")])
    with httpx.Client(transport=mock, base_url="http://server") as http, pytest.raises(httpx.ReadError):
        transport.run_sync(http, flows.submit(["x"], None, 2, {}))
    assert seen == ["/v1/generate"]


def test_poll_gives_up_after_the_retry_budget() -> None:
    mock, seen = flaky([httpx.ConnectError("down")] * (transport.RETRIES + 1))
    with httpx.Client(transport=mock, base_url="http://server") as http, pytest.raises(httpx.ConnectError):
        transport.run_sync(http, flows.get_results(["a"], 1.0))
    assert len(seen) == transport.RETRIES + 1
