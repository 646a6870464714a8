"""Client-side errors beyond the wire errors in scalarlm.protocol.errors."""

from __future__ import annotations

from scalarlm.protocol.errors import ScalarLMError


class GenerationFailed(ScalarLMError):
    """A prompt in a batch finished with an error; the rest of the batch is not returned."""

    status_code = 500
    error_type = "generation_failed"

    def __init__(self, request_id: str, error: str):
        super().__init__(f"generation request {request_id!r} failed: {error}")
        self.request_id = request_id
        self.error = error
