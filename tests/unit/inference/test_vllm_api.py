"""Every vLLM name scalarlm uses lives in scalarlm/inference/vllm_api.py and exists in the installed vLLM."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from scalarlm.inference.process_env import configure_vllm_process_env

configure_vllm_process_env()

PACKAGE = Path(__file__).resolve().parents[3] / "scalarlm"
VLLM_API = PACKAGE / "inference" / "vllm_api.py"


def _vllm_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) for each `from vllm... import name` / `import vllm...` in a file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            found += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name.split(".")[0] == "vllm"]
    return found


IMPORTED = _vllm_imports(VLLM_API)


def test_vllm_api_imports_the_names():
    assert len(IMPORTED) >= 20


@pytest.mark.parametrize(("module", "name"), IMPORTED, ids=[f"{m}.{n}" for m, n in IMPORTED])
def test_each_name_exists_in_installed_vllm(module, name):
    assert hasattr(importlib.import_module(module), name), f"{module}.{name} is gone from this vLLM"


def test_every_name_is_re_exported():
    from scalarlm.inference import vllm_api

    for _, name in IMPORTED:
        assert name in vllm_api.__all__ and getattr(vllm_api, name) is not None, name


def test_no_other_module_imports_vllm():
    others = {
        str(p.relative_to(PACKAGE)): _vllm_imports(p) for p in PACKAGE.rglob("*.py") if p != VLLM_API
    }
    assert {k: v for k, v in others.items() if v} == {}


def test_installed_vllm_is_the_pinned_release():
    import vllm

    assert vllm.__version__.split("+")[0] == "0.32.0"
