"""The control plane: FastAPI app with the batch queue, OpenAI forwarding, health and metrics."""

from scalarlm.server.app import create_app

__all__ = ["create_app"]
