"""save_state / load_state through the real `tinker` SDK, and the RestClient's listings of what was saved.

The proof of a saved state is the loss curve: after `save_state` at step k, loading it with its optimizer state
(into a fresh training client or back into the same one) continues exactly on the uninterrupted run's losses;
loading the weights only gives the same next loss (same weights) but a fresh optimizer, and the same fresh-optimizer
curve in a fresh client as in the same one.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.slow

DATA = [([5, 17, 23, 42, 7, 99, 3, 11], 1), ([8, 8, 30, 31, 32, 33, 34, 35], 3)]
ADAM = types.AdamParams(learning_rate=2e-2)


def _data() -> list[types.Datum]:
    out = []
    for tokens, first in DATA:
        weights = [0.0] * (first - 1) + [1.0] * (len(tokens) - first)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights}))  # fmt: skip
    return out


def _steps(training: Any, n: int) -> list[float]:
    """n SL steps; the loss each forward_backward reported (before its optim_step)."""
    losses = []
    for _ in range(n):
        fb = training.forward_backward(_data(), "cross_entropy")
        training.optim_step(ADAM).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses


def _load(training: Any, path: str, optimizer: bool) -> None:
    with warnings.catch_warnings():  # the SDK marks load_state deprecated in favour of the ServiceClient calls
        warnings.simplefilter("ignore", FutureWarning)
        (training.load_state_with_optimizer if optimizer else training.load_state)(path).result()


@pytest.fixture(scope="module")
def saved(service: Any) -> dict[str, Any]:
    """A LoRA run: 2 steps, save_state("after-2"), then 3 more steps (the uninterrupted curve)."""
    base = service.get_server_capabilities().supported_models[0].model_name
    start = time.monotonic()
    training = service.create_lora_training_client(base_model=base, rank=8, seed=3).result()
    _steps(training, 2)
    path = training.save_state("after-2").result().path
    uninterrupted = _steps(training, 3)
    print(f"run + save_state: {time.monotonic() - start:.1f} s")
    return {"training": training, "path": path, "losses": uninterrupted, "base": base}


def test_load_state_with_optimizer_continues_the_uninterrupted_run(service: Any, saved: dict[str, Any]) -> None:
    start = time.monotonic()
    fresh = service.create_training_client_from_state_with_optimizer(saved["path"]).result()
    assert fresh.get_info().is_lora and fresh.get_info().lora_rank == 8
    assert _steps(fresh, 3) == pytest.approx(saved["losses"], rel=1e-6, abs=1e-7)
    same = saved["training"]  # the same client, 3 steps past the save: back to step 2
    _load(same, saved["path"], optimizer=True)
    assert _steps(same, 3) == pytest.approx(saved["losses"], rel=1e-6, abs=1e-7)
    print(f"load with optimizer (fresh client + same client): {time.monotonic() - start:.1f} s; {saved['losses']}")


def test_load_state_weights_only_restarts_the_optimizer(service: Any, saved: dict[str, Any]) -> None:
    start = time.monotonic()
    same = saved["training"]
    _load(same, saved["path"], optimizer=False)
    restarted = _steps(same, 3)
    assert restarted[0] == pytest.approx(saved["losses"][0], rel=1e-6)  # the saved weights
    # A fresh Adam's first update differs from one with two steps of moments behind it.
    assert abs(restarted[1] - saved["losses"][1]) > 1e-3 * abs(saved["losses"][1]), (restarted, saved["losses"])
    fresh = service.create_training_client_from_state(saved["path"]).result()
    assert _steps(fresh, 3) == pytest.approx(restarted, rel=1e-6, abs=1e-7)
    print(f"load weights only (same client + fresh client): {time.monotonic() - start:.1f} s")


def test_saved_state_refusals(service: Any, saved: dict[str, Any]) -> None:
    """A taken name, a missing path, a state of another shape: the SDK's exceptions, and nothing else changes."""
    training = saved["training"]
    with pytest.raises(tinker.RequestFailedError, match="overwrite"):  # a failed future: the SDK retries a 409
        training.save_state("after-2").result()
    run = saved["path"].split("/")[2]
    with pytest.raises(tinker.NotFoundError, match="no saved state"):
        _load(training, f"tinker://{run}/weights/never-saved", optimizer=True)
    with pytest.raises(tinker.BadRequestError, match="tinker path"):
        _load(training, "s3://bucket/weights", optimizer=True)
    full = service.create_lora_training_client(base_model=saved["base"], rank=8,
                                               user_metadata={"adapter_type": "full"}).result()  # fmt: skip
    with pytest.raises(tinker.BadRequestError, match="holds lora weights"):
        _load(full, saved["path"], optimizer=False)
    assert training.forward(_data(), "cross_entropy").result().metrics["loss:sum"] > 0


def test_rest_client_lists_runs_checkpoints_and_weights_info(service: Any, saved: dict[str, Any],
                                                            server: tuple[str, Path]) -> None:  # fmt: skip
    start = time.monotonic()
    training, path = saved["training"], saved["path"]
    run_id = training.get_info().model_id
    sampler_path = training.save_weights_for_sampler("listed").result().path
    rest = service.create_rest_client()

    runs = rest.list_training_runs(limit=100).result()
    mine = next(r for r in runs.training_runs if r.training_run_id == run_id)
    assert mine.is_lora and mine.lora_rank == 8 and mine.base_model == saved["base"]
    assert mine.last_checkpoint.tinker_path == path and mine.last_sampler_checkpoint.tinker_path == sampler_path
    assert runs.cursor.total_count >= 2 and len(rest.list_training_runs(limit=1).result().training_runs) == 1
    assert rest.get_training_run_by_tinker_path(path).result().training_run_id == run_id

    listed = rest.list_checkpoints(run_id).result().checkpoints
    assert [(c.checkpoint_type, c.checkpoint_id, c.tinker_path) for c in listed] == [
        ("training", "weights/after-2", path), ("sampler", "sampler_weights/listed", sampler_path)]  # fmt: skip
    assert listed[0].size_bytes > 0
    everyone = rest.list_user_checkpoints(limit=1000).result().checkpoints
    assert {path, sampler_path} <= {c.tinker_path for c in everyone}

    info = rest.get_weights_info_by_tinker_path(path).result()
    assert (info.base_model, info.is_lora, info.lora_rank, info.train_mlp) == (saved["base"], True, 8, True)
    assert rest.get_weights_info_by_tinker_path(sampler_path).result().is_lora
    sampled = service.create_sampling_client(model_path=sampler_path).sample(
        types.ModelInput.from_ints([5, 17]), num_samples=1, sampling_params=types.SamplingParams(max_tokens=2)).result()
    assert len(sampled.sequences[0].tokens) == 2

    rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    assert [c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints] == [path]
    with pytest.raises(tinker.NotFoundError):
        rest.get_weights_info_by_tinker_path(f"tinker://{run_id}/weights/never-saved").result()
    manifest = server[1] / "jobs" / run_id / "tinker" / "weights" / "after-2" / "manifest.json"
    before = manifest.read_text()
    assert training.save_state("after-2", overwrite=True).result().path == path  # replaced in place
    assert manifest.read_text() != before and len(rest.list_checkpoints(run_id).result().checkpoints) == 1
    print(f"RestClient listings: {time.monotonic() - start:.1f} s")


def test_a_team_key_sees_only_its_own_runs_and_checkpoints(server: tuple[str, Path], saved: dict[str, Any],
                                                           keys: dict[str, str]) -> None:  # fmt: skip
    start = time.monotonic()
    url = server[0]
    team_a = tinker.ServiceClient(base_url=url, api_key=keys["a"])
    training = team_a.create_lora_training_client(base_model=saved["base"], rank=4, seed=5).result()
    run_id = training.get_info().model_id
    path = training.save_state("team-a").result().path
    theirs = saved["training"].get_info().model_id  # made with the admin key
    rest = {name: tinker.RestClient(base_url=url, api_key=key) for name, key in keys.items()}

    def runs(name: str) -> set[str]:
        return {r.training_run_id for r in rest[name].list_training_runs(limit=100).result().training_runs}

    def checkpoints(name: str) -> set[str]:
        return {c.tinker_path for c in rest[name].list_user_checkpoints(limit=1000).result().checkpoints}

    assert run_id in runs("a") and theirs not in runs("a")
    assert run_id not in runs("b") and theirs not in runs("b")
    assert {run_id, theirs} <= runs("admin")
    assert path in checkpoints("a") and saved["path"] not in checkpoints("a")
    assert path not in checkpoints("b") and {path, saved["path"]} <= checkpoints("admin")
    assert [c.tinker_path for c in rest["a"].list_checkpoints(run_id).result().checkpoints] == [path]
    for call in (lambda: rest["b"].get_training_run(run_id), lambda: rest["b"].list_checkpoints(run_id),
                 lambda: rest["b"].get_weights_info_by_tinker_path(path),
                 lambda: rest["b"].delete_checkpoint_from_tinker_path(path)):  # fmt: skip
        with pytest.raises(tinker.NotFoundError):
            call().result()
    assert path in checkpoints("a")  # b's delete removed nothing
    assert rest["admin"].get_training_run(run_id).result().model_owner == rest["a"].get_training_run(
        run_id).result().model_owner != "local"
    # the training and sampling routes too: b cannot read, train, save, load or sample a's run; a and admin can
    sampler_path = training.save_weights_for_sampler("team-a-sampler").result().path
    calls = [("get_info", {"model_id": run_id}), ("optim_step", {"model_id": run_id, "adam_params": {}}),
             ("save_weights", {"model_id": run_id, "path": "b-was-here"}),
             ("save_weights_for_sampler", {"model_id": run_id, "path": "b-sampler"}),
             ("load_weights", {"model_id": run_id, "path": path}),
             ("create_sampling_session", {"model_path": sampler_path, "session_id": "s", "sampling_session_seq_id": 0}),
             ("asample", {"model_path": sampler_path, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                          "num_samples": 1, "sampling_params": {"max_tokens": 1}})]  # fmt: skip
    for route, body in calls:
        answer = httpx.post(f"{url}/api/v1/{route}", json=body, headers={"X-API-Key": keys["b"]}, timeout=30)
        assert answer.status_code == 404, (route, answer.status_code, answer.text)
        assert "no training client" in answer.text
    for who in ("a", "admin"):
        answer = httpx.post(f"{url}/api/v1/get_info", json={"model_id": run_id}, headers={"X-API-Key": keys[who]})
        assert answer.status_code == 200 and answer.json()["model_id"] == run_id
    with pytest.raises(tinker.NotFoundError):  # the SDK's own way in: a client of b from a's saved state
        tinker.ServiceClient(base_url=url, api_key=keys["b"]).create_training_client_from_state(path).result()
    assert rest["a"].list_checkpoints(run_id).result().checkpoints == [
        c for c in rest["admin"].list_checkpoints(run_id).result().checkpoints]  # b saved nothing into a's run
    assert {c.tinker_path for c in rest["a"].list_checkpoints(run_id).result().checkpoints} == {path, sampler_path}
    team_a.close("success").result()
    print(f"per-key listings: {time.monotonic() - start:.1f} s")


def test_a_training_client_counts_against_the_keys_max_jobs(server: tuple[str, Path], keys: dict[str, str]) -> None:
    """A training client is a trainer: a key with max_jobs=1 gets 429 (with Retry-After) for a second one while the
    first runs, and may make another once it has ended."""
    url, limited = server[0], {"X-API-Key": keys["limited"]}
    base = httpx.get(f"{url}/api/v1/get_server_capabilities", headers=limited).json()["supported_models"][0]
    body = {"base_model": base["model_name"], "lora_config": {"rank": 4}, "session_id": "s", "model_seq_id": 0}
    first = httpx.post(f"{url}/api/v1/create_model", json=body, headers=limited, timeout=60)
    assert first.status_code == 200, first.text
    model_id = first.json()["model_id"]
    second = httpx.post(f"{url}/api/v1/create_model", json=body, headers=limited, timeout=60)
    assert second.status_code == 429 and int(second.headers["Retry-After"]) >= 1
    assert "limit is 1" in second.text
    admin = {"Authorization": f"Bearer {keys['admin']}"}
    assert httpx.post(f"{url}/v1/megatron/cancel/{model_id}", headers=admin, timeout=60).status_code == 200
    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/v1/megatron/train/{model_id}", headers=admin).json()["job_status"]["status"] not in (
            "CANCELLED", "FAILED", "COMPLETED"):  # fmt: skip
        assert time.monotonic() < deadline, "the cancelled training client did not end"
        time.sleep(0.5)
    third = httpx.post(f"{url}/api/v1/create_model", json=body, headers=limited, timeout=60)
    assert third.status_code == 200, third.text
    httpx.post(f"{url}/v1/megatron/cancel/{third.json()['model_id']}", headers=admin, timeout=60)
