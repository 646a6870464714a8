"""A renderer-free structural check of Helm templates: strip Go template actions, then parse as YAML.

Control lines (`{{- if }}`, `{{- end }}`, `{{- range }}`, `{{ fail }}`, variable assignments) are
dropped; a line that is only an `include`/`toYaml` (which would expand to a block) becomes a comment;
any other `{{ ... }}` becomes a scalar placeholder. What remains must be valid YAML documents whose
structure (kinds, keys, probe paths) the tests can read without Helm.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

ACTION = re.compile(r"\{\{-?\s*(.*?)\s*-?\}\}")
CONTROL = re.compile(r"^(if|else|end|range|with|define|fail|block|template|/\*|\$[A-Za-z_]\w*\s*:?=)")
PLACEHOLDER = "TEMPLATED"


def strip_template(text: str) -> str:
    """The template's text with every action replaced so that YAML can parse it."""
    out: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        whole = ACTION.fullmatch(stripped)
        if whole:
            body = whole.group(1)
            if CONTROL.match(body):
                continue
            indent = len(line) - len(line.lstrip())
            out.append(" " * indent + f"# {PLACEHOLDER} block")
            continue
        out.append(ACTION.sub(PLACEHOLDER, line))
    return "\n".join(out) + "\n"


def parse_template(text: str) -> list[dict[str, Any]]:
    """Parse a stripped template into its YAML documents (empty ones dropped)."""
    return [doc for doc in yaml.safe_load_all(strip_template(text)) if doc]
