"""The sync client and its async twin offer the same API: same public methods, same parameters (names, kinds,
defaults, annotations), each twin method one statement over a shared flow; handles hold a runner, never a client."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from scalarlm.client import (
    AsyncRLSession,
    AsyncScalarLM,
    AsyncStepFuture,
    AsyncTrainingJob,
    RLSession,
    ScalarLM,
    StepFuture,
    TrainingJob,
)
from scalarlm.protocol.training import SessionResponse, SessionStepState

TWINS = [(ScalarLM, AsyncScalarLM), (TrainingJob, AsyncTrainingJob), (RLSession, AsyncRLSession),
         (StepFuture, AsyncStepFuture)]  # fmt: skip
# Sync-only or async-only by nature: a pooled connection to close, context-manager and await protocols.
ONE_SIDED = {"close", "__enter__", "__exit__", "__aenter__", "__aexit__", "__await__"}
# Client methods that build a handle from a created resource: two statements (the flow, then the handle).
CONSTRUCTORS = {"rl_session", "__init__"}


def _methods(cls: type) -> dict[str, object]:
    names = {n for n in dir(cls) if not n.startswith("_") or n in ONE_SIDED}
    return {n: getattr(cls, n) for n in names if callable(getattr(cls, n)) and not isinstance(getattr(cls, n), type)}


def _untwinned(annotation: object) -> str:
    """An annotation with the twin's names made equal (`AsyncTrainingJob` -> `TrainingJob`)."""
    return str(annotation).replace("Async", "")


def _shape(sig: inspect.Signature) -> list[tuple[str, object, object, str]]:
    return [(p.name, p.kind, p.default, _untwinned(p.annotation)) for p in sig.parameters.values()]


def _own(cls: type, name: str) -> bool:
    """Defined by the twin classes themselves (or their mixins), not by `object`."""
    return any(name in vars(base) for base in cls.__mro__ if base is not object)


@pytest.mark.parametrize(("sync", "async_"), TWINS, ids=[s.__name__ for s, _ in TWINS])
def test_twins_have_the_same_methods_and_signatures(sync: type, async_: type) -> None:
    sync_methods = {n for n in _methods(sync) if n not in ONE_SIDED and _own(sync, n)}
    async_methods = {n for n in _methods(async_) if n not in ONE_SIDED and _own(async_, n)}
    assert sync_methods == async_methods
    for name in sorted(sync_methods):
        s, a = inspect.signature(getattr(sync, name)), inspect.signature(getattr(async_, name))
        assert _shape(s) == _shape(a), name
        async_kind = inspect.iscoroutinefunction(getattr(async_, name)) or name == "pipeline"
        assert async_kind, f"{async_.__name__}.{name} is not awaitable"


def _body_statements(func: object) -> int:
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))  # type: ignore[arg-type]
    body = tree.body[0].body  # type: ignore[attr-defined]
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return len(body)


@pytest.mark.parametrize(("sync", "async_"), TWINS, ids=[s.__name__ for s, _ in TWINS])
def test_each_twin_method_is_one_statement(sync: type, async_: type) -> None:
    """What a method does lives in its flow (or the handles' shared private base), written once."""
    for cls in (sync, async_):
        ours = [c for c in cls.__mro__ if c.__module__.startswith("scalarlm.client") and not c.__name__.startswith("_")]
        for base in ours:
            for name, func in vars(base).items():
                if inspect.isfunction(func) and not name.startswith("_"):
                    limit = 2 if name in CONSTRUCTORS else 1
                    assert _body_statements(func) <= limit, f"{base.__name__}.{name}"


def test_handles_hold_a_runner_not_a_client() -> None:
    info = SessionResponse(session_id="session-1", model_name="session-1", status="RUNNING")
    calls = []
    run = calls.append
    session = RLSession(run, info)
    future = StepFuture(session, SessionStepState(session_id="session-1", request=1, state="queued", accepted=0.0))
    job = TrainingJob(run, "job-1")
    for handle in (session, future, job):
        assert not any(isinstance(v, (ScalarLM, AsyncScalarLM)) for v in vars(handle).values())
    assert session._run is run and job._run is run and future.session is session
