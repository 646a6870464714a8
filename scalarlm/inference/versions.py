"""Which models this worker serves and which weights version each one has loaded."""

from __future__ import annotations


class ModelVersions:
    """Per-model weights version (0 = base weights); hot-swap bumps a model's version here."""

    def __init__(self, base_model: str) -> None:
        self.base_model = base_model
        self._versions: dict[str, int] = {base_model: 0}

    def get(self, model: str) -> int | None:
        """The loaded version of `model`, or None when this worker does not serve it."""
        return self._versions.get(model)

    def set(self, model: str, version: int) -> None:
        """Record that `model` now serves weights `version`."""
        self._versions[model] = version

    def forget(self, model: str) -> None:
        """Record that `model`'s weights are no longer loaded (the base model is always served)."""
        if model != self.base_model:
            self._versions.pop(model, None)

    def loaded(self) -> dict[str, int]:
        """A copy of every served model's version (sent with each get_work)."""
        return dict(self._versions)

    def fingerprint(self, model: str) -> str:
        """The `system_fingerprint` of responses produced by `model` at its current version."""
        return f"scalarlm-{model}-v{self._versions.get(model, 0)}"
