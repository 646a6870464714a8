"""Wire models shared by client and server. Imports nothing else of scalarlm."""

from scalarlm.protocol.errors import (
    Conflict,
    EngineUnavailable,
    ErrorResponse,
    Forbidden,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    QueueFull,
    ScalarLMError,
    Unauthorized,
    error_from_response,
)

__all__ = [
    "Conflict",
    "EngineUnavailable",
    "ErrorResponse",
    "Forbidden",
    "InvalidRequest",
    "NotFound",
    "PayloadTooLarge",
    "QueueFull",
    "ScalarLMError",
    "Unauthorized",
    "error_from_response",
]
