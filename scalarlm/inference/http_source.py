"""Split mode: the control plane's queue as a `WorkSource`, over its worker routes."""

from __future__ import annotations

import logging

import httpx

from scalarlm.protocol.errors import error_from_response
from scalarlm.protocol.generate import FinishWorkRequest, FinishWorkResponse, GetWorkRequest, GetWorkResponse

logger = logging.getLogger(__name__)


class HttpWorkSource:
    """`WorkSource` calling `POST {api_url}/v1/generate/get_work` and `/finish_work` with protocol JSON."""

    def __init__(
        self,
        api_url: str,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.api_url = api_url.rstrip("/")
        self.client = httpx.AsyncClient(
            base_url=self.api_url, headers=headers, timeout=httpx.Timeout(timeout, connect=10.0), transport=transport
        )

    async def get_work(self, request: GetWorkRequest) -> GetWorkResponse:
        """Lease work; raises the typed protocol error for a non-2xx answer."""
        resp = await self.client.post("/v1/generate/get_work", content=request.model_dump_json(),
                                      headers={"content-type": "application/json"})
        self._check(resp)
        return GetWorkResponse.model_validate_json(resp.content)

    async def finish_work(self, request: FinishWorkRequest) -> FinishWorkResponse:
        """Post results; raises the typed protocol error for a non-2xx answer."""
        resp = await self.client.post("/v1/generate/finish_work", content=request.model_dump_json(),
                                      headers={"content-type": "application/json"})
        self._check(resp)
        return FinishWorkResponse.model_validate_json(resp.content)

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self.client.aclose()

    @staticmethod
    def _check(resp: httpx.Response) -> None:
        if resp.is_success:
            return
        try:
            body: object = resp.json()
        except ValueError:
            body = resp.text
        retry_after = resp.headers.get("retry-after")
        raise error_from_response(resp.status_code, body, float(retry_after) if retry_after else None)
