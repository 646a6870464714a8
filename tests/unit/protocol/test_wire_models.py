"""Wire models: what they accept, what they reject and how errors travel."""

import pytest
from pydantic import ValidationError

from scalarlm.protocol.errors import InvalidRequest, NotFound, QueueFull, ScalarLMError, error_from_response
from scalarlm.protocol.generate import EngineLoad, GenerateRequest
from scalarlm.protocol.training import TrainArgs, check_name


def test_generate_request_accepts_scalarlm_sdk_shape():
    req = GenerateRequest.model_validate({"prompts": ["a", {"prompt": "b"}, {"messages": [{"role": "user", "content": "c"}]}], "max_tokens": 4})
    assert len(req.prompts) == 3
    assert req.sampling().max_tokens == 4 and req.sampling().n == 1


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompts": []}, "prompts"),
        ({"prompts": ["a"], "max_tokens": 0}, "max_tokens"),
        ({"prompts": ["a"], "temperature": -1}, "temperature"),
        ({"prompts": [{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}]}, "exactly one"),
        ({"prompts": ["a"], "bogus": 1}, "bogus"),
    ],
)
def test_generate_request_rejects_bad_input_naming_the_field(body, field):
    with pytest.raises(ValidationError, match=field):
        GenerateRequest.model_validate(body)


def test_train_args_reject_unknown_keys_and_bad_tp():
    assert TrainArgs(max_steps=5, learning_rate=1e-3).max_steps == 5
    with pytest.raises(ValidationError, match="max_stepz"):
        TrainArgs.model_validate({"max_stepz": 5})
    with pytest.raises(ValidationError, match="tensor_parallel_size"):
        TrainArgs(cpu_ranks=3, tensor_parallel_size=2)
    assert TrainArgs(adapter_type="none").adapter_type == "full"


@pytest.mark.parametrize("bad", ["../x", "/abs", "a/b", "", ".hidden", "a..b", "x" * 200])
def test_names_cannot_escape_a_directory(bad):
    with pytest.raises(ValueError):
        check_name(bad)


def test_error_round_trip_keeps_class_message_and_retry_after():
    body = QueueFull("engine busy", retry_after=2.0).to_response().model_dump()
    exc = error_from_response(429, body, retry_after=2.0)
    assert isinstance(exc, QueueFull) and exc.message == "engine busy" and exc.retry_after == 2.0
    assert isinstance(error_from_response(404, {"error": {"message": "no", "type": "x", "code": 404}}), NotFound)
    assert isinstance(error_from_response(400, {"detail": "bad"}), InvalidRequest)
    assert type(error_from_response(502, "gateway")) is ScalarLMError


def test_engine_load_free_slots():
    assert EngineLoad(running=3, waiting=1, max_num_seqs=8).free_slots() == 4
    assert EngineLoad(running=0, max_num_seqs=8, kv_cache_usage=0.99).free_slots() == 0
