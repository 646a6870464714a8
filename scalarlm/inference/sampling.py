"""Map protocol sampling knobs to `vllm.SamplingParams` faithfully, and work items to engine prompts."""

from __future__ import annotations

from typing import Any

from scalarlm.inference.vllm_api import RequestOutputKind, parse_model_prompt
from scalarlm.inference.vllm_api import SamplingParams as VllmSamplingParams
from scalarlm.protocol.generate import SamplingParams, WorkItem

# Knobs passed to vLLM under the same name whenever the request sets them; unset ones keep vLLM's default.
_PASSTHROUGH = (
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stop",
    "seed",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
)


def to_vllm_sampling(params: SamplingParams, default_max_tokens: int) -> VllmSamplingParams:
    """vLLM sampling params for one queued request.

    Unset temperature means greedy (0), as ScalarLM's queue does; unset max_tokens means the configured
    default. Only the final output is returned (the queue does not stream), which keeps the engine cheap.
    """
    kwargs: dict[str, Any] = {
        "max_tokens": params.max_tokens if params.max_tokens is not None else default_max_tokens,
        "temperature": params.temperature if params.temperature is not None else 0.0,
        "output_kind": RequestOutputKind.FINAL_ONLY,
    }
    for name in _PASSTHROUGH:
        value = getattr(params, name)
        if value is not None:
            kwargs[name] = value
    return VllmSamplingParams(**kwargs)


class SamplingCache:
    """Reuses one `vllm.SamplingParams` per distinct protocol setting (a batch usually shares one).

    vLLM treats a request's params as read-only (it clones them before changing anything), so one
    object may serve many requests, as `LLM.generate` does with a single params object.
    """

    def __init__(self, default_max_tokens: int, max_entries: int = 256) -> None:
        self.default_max_tokens = default_max_tokens
        self.max_entries = max_entries
        self._cache: dict[tuple[Any, ...], VllmSamplingParams] = {}

    def get(self, params: SamplingParams) -> VllmSamplingParams:
        """The vLLM params for `params`, built once per distinct value."""
        key = tuple(tuple(v) if isinstance(v, list) else v for v in params.__dict__.values())
        cached = self._cache.get(key)
        if cached is None:
            if len(self._cache) >= self.max_entries:
                self._cache.clear()
            cached = self._cache[key] = to_vllm_sampling(params, self.default_max_tokens)
        return cached


def engine_prompts(items: list[WorkItem], tokenizer: Any, renderer: Any = None) -> list[dict[str, Any] | Exception]:
    """The vLLM prompt of each leased item, every text prompt tokenized in one batched call (special tokens added,
    as vLLM's own tokenization of a text prompt does), so the engine is handed token ids and does not tokenize each
    request on its own; chat messages rendered with the chat template. A tokenizer that cannot batch leaves the
    text to vLLM. An item whose messages cannot be rendered gets the exception, to become its own error result.

    With `renderer` (the engine's `AsyncLLM.renderer`) each prompt is also rendered here into vLLM's engine input,
    as `AsyncLLM.add_request` would otherwise do for each request on its own thread-pool hop (a rendered input is
    added inline); an item that cannot be rendered gets the exception."""
    prompts: list[dict[str, Any] | Exception] = [{} for _ in items]
    for i, item in enumerate(items):
        if item.messages is not None:
            try:
                prompts[i] = to_engine_prompt(item, tokenizer)
            except Exception as exc:
                prompts[i] = exc
    texts = [i for i, item in enumerate(items) if item.messages is None]
    if not texts:
        return prompts
    try:
        encoded = tokenizer([items[i].prompt or "" for i in texts], add_special_tokens=True)["input_ids"]
    except Exception:  # e.g. a tokenizer wrapper without batch encoding: vLLM tokenizes each text itself
        encoded = None
    for n, i in enumerate(texts):
        prompts[i] = {"prompt_token_ids": list(encoded[n])} if encoded is not None else {"prompt": items[i].prompt or ""}
    return prompts if renderer is None else [render(prompt, renderer) for prompt in prompts]


def render(prompt: dict[str, Any] | Exception, renderer: Any) -> dict[str, Any] | Exception:
    """vLLM's engine input for one prompt, rendered the way `add_request` renders a raw prompt (the renderer's default
    completion tokenize parameters); the exception, if it cannot be."""
    if isinstance(prompt, Exception):
        return prompt
    try:
        return renderer.render_cmpl([parse_model_prompt(renderer.model_config, prompt)])[0]
    except Exception as exc:
        return exc


def to_engine_prompt(item: WorkItem, tokenizer: Any) -> dict[str, Any]:
    """The vLLM prompt for a work item: text as-is; chat messages (and any tools) rendered with the model's chat
    template."""
    if item.messages is not None:
        messages = [m.model_dump(exclude_none=True) for m in item.messages]
        ids = tokenizer.apply_chat_template(messages, tools=item.tools, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return {"prompt_token_ids": list(ids)}
    return {"prompt": item.prompt or ""}
