"""generate() arguments become the wire payloads the server expects; bad ones fail before sending."""

from __future__ import annotations

import json

import pytest

from scalarlm.client.payloads import (
    generate_payload,
    normalize_prompts,
    result_index,
    sampling_fields,
    upload_rows,
)
from scalarlm.protocol.errors import InvalidRequest
from scalarlm.protocol.generate import GenerateRequest

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_strings_chats_and_dicts_normalize_in_order() -> None:
    wire = normalize_prompts(["a", CHAT, {"prompt": "b"}, {"messages": CHAT}])
    assert wire == ["a", {"messages": CHAT}, {"prompt": "b"}, {"messages": CHAT}]
    assert normalize_prompts("lonely") == ["lonely"]


@pytest.mark.parametrize("bad", [[], [{"role": "user", "content": "x"}], [{"text": "x"}], [3],
                                 [{"prompt": "a", "messages": CHAT}]])
def test_bad_prompts_raise_invalid_request(bad: list) -> None:
    with pytest.raises(InvalidRequest):
        normalize_prompts(bad)


def test_sampling_kwargs_validated() -> None:
    assert sampling_fields(8, {"temperature": 0.0, "seed": 3}) == {"max_tokens": 8, "temperature": 0.0, "seed": 3}
    assert sampling_fields(None, {}) == {}
    with pytest.raises(TypeError, match="tempreature"):
        sampling_fields(None, {"tempreature": 1.0})
    with pytest.raises(InvalidRequest) as info:
        sampling_fields(0, {})
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidRequest):
        sampling_fields(None, {"top_p": 2.0})
    with pytest.raises(InvalidRequest, match="n=2 needs a temperature above 0"):  # what vLLM would refuse per item
        sampling_fields(4, {"n": 2})


def test_generate_payload_is_a_valid_generate_request() -> None:
    payload = generate_payload(normalize_prompts(["a", CHAT]), "tiny", sampling_fields(4, {"n": 2, "temperature": 1.0}))
    request = GenerateRequest.model_validate(payload)
    assert request.model == "tiny" and request.max_tokens == 4 and request.n == 2 and request.wait_seconds == 0
    assert "model" not in generate_payload(["a"], None, {})


def test_upload_rows_match_scalarlm_file_format() -> None:
    rows = json.loads(upload_rows(normalize_prompts(["a", CHAT]), None, sampling_fields(5, {"temperature": 0.5})))
    assert rows[0] == {"prompt": "a", "model": None, "max_tokens": 5, "request_type": "generate",
                       "temperature": 0.5}
    assert rows[1]["messages"] == CHAT and "prompt" not in rows[1]
    assert result_index("abc_000000012") == 12 and result_index("x_y_3") == 3
