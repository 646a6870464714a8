"""scalarlm: train and serve LLMs on one cluster.

The top-level package exposes the client, so `pip install scalarlm` is enough to talk to a
server: `llm = scalarlm.ScalarLM("http://host:8000")`. The client is imported lazily so that
server processes do not pay for it.
"""

from typing import Any

# Module-level default URL, as ScalarLM's SDK reads it (`scalarlm.api_url = ...`).
api_url: str | None = None

__all__ = ["ScalarLM", "AsyncScalarLM", "SupermassiveIntelligence", "api_url"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("ScalarLM", "AsyncScalarLM", "SupermassiveIntelligence", "rewards"):
        import importlib

        if name == "rewards":
            return importlib.import_module("scalarlm.rewards")
        return getattr(importlib.import_module("scalarlm.client"), name)
    raise AttributeError(f"module 'scalarlm' has no attribute {name!r}")
