"""Schemathesis fuzzes every operation of the server's own OpenAPI schema against a real
`scalarlm serve --role api` subprocess (real SQLite queue, real job registry; no inference worker),
once with a valid key and once without: no answer may be a 5xx (except the OpenAI routes' documented
503 "no inference worker" on this engine-less server), and documented responses must match their schema.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from schemathesis.core.failures import FailureGroup
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

from security_serve import serve

KEY = "fuzz-key"
MAX_EXAMPLES = 30
# Routes forwarded to a worker: on a control plane with no worker they answer 503 EngineUnavailable.
FORWARDED = {"/v1/models", "/v1/completions", "/v1/chat/completions"}
TALLY: dict[str, int] = {"requests": 0, "5xx": 0}


@pytest.fixture(scope="module")
def api_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    home = tmp_path_factory.mktemp("fuzz") / "home"
    # Short long-polls: the fuzzer's wait_seconds must not make each example wait a minute.
    # One trainer at a time: fuzzed submissions and RL sessions wait QUEUED instead of starting ~30 trainers at once.
    env = {"SCALARLM_API_KEYS": KEY, "SCALARLM_RESPONSE_TIMEOUT": "0.2", "SCALARLM_GENERATE__MAX_WAIT_SECONDS": "0.5",
           "SCALARLM_TRAINING__MAX_RUNNING_JOBS": "1"}
    with serve(["--role", "api", "--model", str(tiny_model_dir)], home, env) as (url, _, _):
        yield url
    # Fuzzed requests may start trainers (RL sessions wait for steps); they must not outlive this module.
    subprocess.run(["pkill", "-KILL", "-f", str(home)], check=False)


def check(case, response, with_key: bool) -> None:
    """Count the request and apply the checks: no 5xx, documented responses conform."""
    TALLY["requests"] += 1
    status = response.status_code
    if status >= 500:
        TALLY["5xx"] += 1
        expected = status == 503 and case.path in FORWARDED and with_key
        assert expected, f"{case.method} {case.path} -> {status}: {response.text[:500]}"
    else:
        case.validate_response(response, checks=[response_schema_conformance, content_type_conformance])
    if not with_key and case.path not in ("/v1/health", "/api/v1/healthz", "/metrics"):  # health probes
        assert status in (401, 404, 405, 413), f"{case.method} {case.path} without a key -> {status}"


def fuzz(api_url: str, with_key: bool, max_examples: int) -> list[str]:
    """Run every operation of the live schema for `max_examples` cases; return the failures."""
    schema = schemathesis.openapi.from_url(f"{api_url}/openapi.json")
    headers = {"Authorization": f"Bearer {KEY}"} if with_key else {}
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def run(case) -> None:
            check(case, case.call(base_url=api_url, headers=headers, timeout=30), with_key)

        try:
            run()
        except (AssertionError, FailureGroup) as e:  # the first failure per operation is enough to report it
            failures.append(f"{operation.method.upper()} {operation.path}: {str(e)[:1500]}")
    return failures


def test_fuzz_every_route_with_a_key(api_url: str) -> None:
    failures = fuzz(api_url, with_key=True, max_examples=MAX_EXAMPLES)
    assert not failures, "\n".join(failures)


def test_fuzz_every_route_without_a_key(api_url: str) -> None:
    failures = fuzz(api_url, with_key=False, max_examples=10)
    assert not failures, "\n".join(failures)


def test_report_fuzz_tally() -> None:
    """Print the figures docs/security.md quotes (requests tried, 5xx seen)."""
    print(f"\nfuzz: {TALLY['requests']} requests, {TALLY['5xx']} 5xx (all 503 from forwarded routes with no worker)")
