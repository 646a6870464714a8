"""Protocol sampling params reach vLLM unchanged; unset ones get ScalarLM's defaults."""

from __future__ import annotations

from scalarlm.inference.process_env import configure_vllm_process_env

configure_vllm_process_env()

from scalarlm.inference.sampling import to_engine_prompt, to_vllm_sampling  # noqa: E402
from scalarlm.inference.vllm_api import RequestOutputKind  # noqa: E402
from scalarlm.protocol.generate import ChatMessage, SamplingParams, WorkItem  # noqa: E402


def test_defaults_are_greedy_with_configured_max_tokens() -> None:
    sp = to_vllm_sampling(SamplingParams(), default_max_tokens=24)
    assert sp.temperature == 0.0
    assert sp.max_tokens == 24
    assert sp.n == 1
    assert sp.logprobs is None
    assert sp.seed is None
    assert sp.output_kind == RequestOutputKind.FINAL_ONLY


def test_every_knob_is_passed_through() -> None:
    params = SamplingParams(
        max_tokens=7,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        n=3,
        stop=["\n", "END"],
        seed=1234,
        logprobs=2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        ignore_eos=True,
    )
    sp = to_vllm_sampling(params, default_max_tokens=16)
    assert sp.max_tokens == 7
    assert sp.temperature == 0.7
    assert sp.top_p == 0.9
    assert sp.top_k == 40
    assert sp.min_p == 0.05
    assert sp.n == 3
    assert sp.stop == ["\n", "END"]
    assert sp.seed == 1234
    assert sp.logprobs == 2
    assert sp.presence_penalty == 0.5
    assert sp.frequency_penalty == -0.5
    assert sp.repetition_penalty == 1.2
    assert sp.ignore_eos is True


def test_explicit_temperature_is_honoured_and_stop_string_kept() -> None:
    sp = to_vllm_sampling(SamplingParams(temperature=1.5, stop="###"), default_max_tokens=16)
    assert sp.temperature == 1.5
    assert sp.stop == ["###"]


def test_prompts_text_as_is_and_chat_through_the_model_template(tiny_model_dir) -> None:  # noqa: ANN001
    from transformers import AutoTokenizer

    text = WorkItem(request_id="a", model="m", prompt="Hello there", sampling=SamplingParams())
    assert to_engine_prompt(text, tokenizer=None) == {"prompt": "Hello there"}

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    chat = WorkItem(
        request_id="b", model="m", messages=[ChatMessage(role="user", content="hi")], sampling=SamplingParams()
    )
    prompt = to_engine_prompt(chat, tokenizer=tokenizer)
    rendered = tokenizer.decode(prompt["prompt_token_ids"])
    assert rendered.endswith("<|assistant|>\n")  # add_generation_prompt=True
    assert "<|user|>\nhi" in rendered


def test_chat_tools_reach_the_model_template(tiny_model_dir) -> None:  # noqa: ANN001
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = (
        "{% if tools %}{% for tool in tools %}<tool>{{ tool['function']['name'] }}</tool>{% endfor %}{% endif %}"
        "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    )
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    chat = WorkItem(request_id="b", model="m", messages=[ChatMessage(role="user", content="hi")], tools=tools,
                    sampling=SamplingParams())  # fmt: skip
    rendered = tokenizer.decode(to_engine_prompt(chat, tokenizer=tokenizer)["prompt_token_ids"])
    assert rendered.endswith("<tool>add</tool>hi")
    bare = tokenizer.decode(to_engine_prompt(chat.model_copy(update={"tools": None}), tokenizer)["prompt_token_ids"])
    assert bare.endswith("hi") and "<tool>" not in bare


def test_sampling_cache_reuses_params_per_distinct_setting() -> None:
    from scalarlm.inference.sampling import SamplingCache

    cache = SamplingCache(default_max_tokens=16)
    a = cache.get(SamplingParams(temperature=0.5, stop=["x"]))
    assert cache.get(SamplingParams(temperature=0.5, stop=["x"])) is a
    b = cache.get(SamplingParams(temperature=0.5, stop=["y"]))
    assert b is not a and b.stop == ["y"] and a.stop == ["x"]
    assert cache.get(SamplingParams()).temperature == 0.0


def test_a_leased_batch_is_tokenized_at_once_as_vllm_would_each_prompt(tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    from scalarlm.inference.sampling import engine_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = ["Hello there", "", "What is 2 + 2?  Tell me\nnow."]
    chat = WorkItem(request_id="c", model="m", messages=[ChatMessage(role="user", content="hi")],
                    sampling=SamplingParams())  # fmt: skip
    items = [WorkItem(request_id=f"t{i}", model="m", prompt=t, sampling=SamplingParams()) for i, t in enumerate(texts)]
    prompts = engine_prompts([items[0], chat, items[1], items[2]], tokenizer)
    # vLLM encodes a text prompt with add_special_tokens=True; the batched call gives the same ids per prompt.
    assert [p["prompt_token_ids"] for p in (prompts[0], prompts[2], prompts[3])] == [
        tokenizer.encode(t, add_special_tokens=True) for t in texts
    ]
    assert prompts[1] == to_engine_prompt(chat, tokenizer)
    assert engine_prompts(items[:1], tokenizer=None) == [{"prompt": "Hello there"}]  # no batch call: vLLM tokenizes

    tokenizer.chat_template = "{{ raise_exception('this model has no chat template') }}"
    bad = engine_prompts([chat, items[0]], tokenizer)
    assert isinstance(bad[0], Exception) and "no chat template" in str(bad[0])  # that item's own error result
    assert bad[1]["prompt_token_ids"] == tokenizer.encode(texts[0])
