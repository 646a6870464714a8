"""What the console, CLI and export tests share: the server handle, its key, a dataset and LoRA train args."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from scalarlm.client import ScalarLM

API_KEY = "console-test-key"
ROWS = [{"input": f"What is {i} + 1?", "output": str(i + 1)} for i in range(32)]
# A short LoRA job: two published versions (2 and 4).
LORA_ARGS = {"max_steps": 4, "learning_rate": 1e-3, "steps_per_publish": 2, "adapter_type": "lora"}


@dataclass(frozen=True)
class Server:
    url: str
    home: Path
    key: str

    def client(self) -> ScalarLM:
        return ScalarLM(self.url, api_key=self.key, timeout=120)
