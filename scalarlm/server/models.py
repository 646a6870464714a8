"""Which model names this control plane serves, and what name the worker knows each by."""

from __future__ import annotations

from pathlib import Path

from scalarlm.config import Settings
from scalarlm.protocol.errors import NotFound
from scalarlm.protocol.generate import ModelVersion


class ModelCatalog:
    """The base model (by its served name or its path); trained models join in later issues."""

    def __init__(self, settings: Settings) -> None:
        self.base = settings.base_model_name
        aliases = {self.base, settings.model}
        model_path = Path(settings.model)
        if model_path.exists():
            aliases.add(str(model_path.resolve()))
        self._aliases = aliases

    def resolve(self, name: str | None) -> str:
        """The canonical name for a requested model (None means the base model); NotFound otherwise."""
        if name is None or name in self._aliases:
            return self.base
        raise NotFound(f"The model `{name}` does not exist.", param="model")

    def versions(self) -> list[ModelVersion]:
        """Every servable model with its newest weights version (workers learn of swaps from this)."""
        return [ModelVersion(name=self.base, version=0, kind="base")]
