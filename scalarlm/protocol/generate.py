"""Wire models of the batch generate queue (ScalarLM 1.151-compatible) and its worker side."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# vLLM's bounds for a request seed (a signed 64-bit integer).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[Any] | None = None


class SubmittedMessage(ChatMessage):
    """A chat message as a client submits it. OpenAI content-part lists are accepted when every part is text: they
    are stored as one string, joined with newlines as vLLM's own chat renderer joins them."""

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content: str | list[Any] | None) -> str | None:
        if not isinstance(content, list):
            return content
        texts = []
        for i, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise ValueError(
                    f"content[{i}] is not a text part ({{'type': 'text', 'text': ...}}): the queue takes text only; "
                    "send images or audio to /v1/chat/completions"
                )
        return "\n".join(texts)


class SamplingParams(BaseModel):
    """Sampling knobs a batch request may set; every one reaches vLLM unchanged."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False


class SubmittedSampling(SamplingParams):
    """Sampling knobs as a client submits them: settings vLLM would refuse for every item, after the batch was
    accepted, are refused at submission. (Stored items are read back as plain `SamplingParams`, so an item queued
    before a check existed is still leased and fails on its own.)"""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="after")
    def _as_vllm_checks(self) -> "SubmittedSampling":
        if self.temperature is not None and self.temperature > 2:
            raise ValueError(f"temperature must be at most 2, got {self.temperature}")
        if self.n > 1 and not self.temperature:
            raise ValueError(
                f"n={self.n} needs a temperature above 0: greedy decoding (temperature unset or 0) gives n identical "
                "completions"
            )
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if "" in stops:
            raise ValueError("stop must not hold an empty string")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be a signed 64-bit integer, got {self.seed}")
        return self


class ChatTools(BaseModel):
    """OpenAI `tools` for the chat prompts of a batch: given to the model's chat template, as vLLM's chat route
    does. The queue returns the completion text; it does not parse tool calls out of it or force one."""

    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    @model_validator(mode="after")
    def _choice(self) -> "ChatTools":
        if self.tool_choice not in (None, "auto", "none"):
            raise ValueError(
                f"tool_choice {self.tool_choice!r}: the queue cannot force a tool call ('auto' or 'none' only); "
                "use /v1/chat/completions for 'required' or a named function"
            )
        return self


class PromptObject(BaseModel):
    """One prompt in object form: plain text or chat messages."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = None
    messages: list[SubmittedMessage] | None = None

    @model_validator(mode="after")
    def _one_of(self) -> "PromptObject":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("each prompt object needs exactly one of 'prompt' or 'messages'")
        if self.messages is not None and not self.messages:
            raise ValueError("'messages' must not be empty")
        return self


Prompt = str | PromptObject


class GenerateRequest(SubmittedSampling, ChatTools):
    """POST /v1/generate. ScalarLM's SDK sends `prompts`, `model`, `max_tokens`."""

    prompts: list[Prompt] = Field(..., min_length=1)
    model: str | None = None
    # Seconds to wait for results before answering (ScalarLM waits; 0 answers once stored).
    wait_seconds: float | None = Field(None, ge=0)

    def sampling(self) -> SamplingParams:
        return SamplingParams.model_validate(self.model_dump(include=set(SamplingParams.model_fields)))


class TopLogprob(BaseModel):
    """One of the most likely tokens at a position of a completion."""

    token_id: int
    token: str | None = None
    logprob: float


class Completion(BaseModel):
    """One of the `n` outputs for a prompt. With sampling `logprobs` k: `logprobs` holds each sampled token's
    log-probability, and for k >= 1 `top_logprobs` the k most likely tokens at each position, most likely first."""

    text: str
    finish_reason: str | None = None
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[TopLogprob]] | None = None
    cumulative_logprob: float | None = None


RequestStatus = Literal["queued", "leased", "completed", "failed"]


class UploadItem(SubmittedSampling, ChatTools):
    """One element of the JSON list sent to POST /v1/generate/upload (ScalarLM's SDK writes
    `prompt`, `model`, `max_tokens`, `request_type`); sampling fields may be set per item."""

    prompt: Prompt | None = None
    messages: list[SubmittedMessage] | None = None
    model: str | None = None
    request_type: str | None = None

    @model_validator(mode="after")
    def _one_of(self) -> "UploadItem":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("each item needs exactly one of 'prompt' or 'messages'")
        return self

    def prompt_object(self) -> PromptObject:
        """The item's prompt as a PromptObject (a nested {"prompt"|"messages"} is unwrapped)."""
        if isinstance(self.prompt, PromptObject):
            return self.prompt
        return PromptObject(prompt=self.prompt, messages=self.messages)


class GenerateResult(BaseModel):
    """One prompt's result. `response` stays null until it is done (ScalarLM's SDK polls on that)."""

    request_id: str
    response: str | None = None
    error: str | None = None
    status: RequestStatus = "queued"
    model: str | None = None
    version: int | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    logprobs: list[float] | None = None
    outputs: list[Completion] | None = None


class GenerateResponse(BaseModel):
    results: list[GenerateResult]


class GetResultsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_ids: list[str] = Field(..., min_length=1)
    # Long-poll: wait up to this many seconds for all of them (null: the server's response_timeout).
    wait_seconds: float | None = Field(None, ge=0)


class UploadResponse(BaseModel):
    """POST /v1/generate/upload: the batch id to download with."""

    request_id: str
    total_requests: int


class DownloadRequest(BaseModel):
    request_id: str
    wait_seconds: float | None = Field(None, ge=0)


class DownloadResponse(BaseModel):
    """POST /v1/generate/download. Results keyed `<batch>_<index>`; `current_index` counts finished ones."""

    request_id: str
    current_index: int
    total_requests: int
    results: dict[str, GenerateResult]


class QueueCounts(BaseModel):
    queued: int = 0
    leased: int = 0
    completed: int = 0
    failed: int = 0


class GenerateMetrics(BaseModel):
    """GET /v1/generate/metrics."""

    queue: QueueCounts
    queue_depth: int
    requests_per_second: float
    tokens_per_second: float
    total_completed: int
    total_tokens: int


class ClearQueueResponse(BaseModel):
    cleared: int


# ---- worker side -------------------------------------------------------------------------------


class EngineLoad(BaseModel):
    """What a worker's engine is doing now; sizes its pulls and the control plane's admission."""

    running: int = 0
    waiting: int = 0
    max_num_seqs: int = 1
    kv_cache_usage: float = Field(0.0, ge=0, le=1)
    # Hot-swap metrics: full-weight reloads done by this worker and the seconds they took in total.
    swaps: int = 0
    swap_seconds: float = 0.0
    # The context length (prompt + output) the engine serves; None until it is known (the engine is not up).
    max_model_len: int | None = None

    def free_slots(self) -> int:
        """Sequences the engine can start now without queueing inside itself."""
        if self.kv_cache_usage >= 0.95:
            return 0
        return max(0, self.max_num_seqs - self.running - self.waiting)


class ModelVersion(BaseModel):
    """A servable model and the newest weights it has: the base model is version 0."""

    name: str
    version: int = 0
    kind: Literal["base", "full", "lora"] = "base"
    path: str | None = None


class GetWorkRequest(BaseModel):
    worker_id: str = "worker-0"
    capacity: int = Field(..., ge=0, le=100_000)
    load: EngineLoad | None = None
    loaded: dict[str, int] = Field(default_factory=dict)
    # The model whose full weights the worker's engine holds now (the base, or a full fine-tune): the queue leases
    # work it can run without a swap first (see queue/store.py `lease`). None: not said.
    holding: str | None = None
    # ScalarLM worker field names, accepted for compatibility.
    batch_size: int | None = None
    loaded_adaptor_count: int | None = None


class WorkItem(BaseModel):
    request_id: str
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    sampling: SamplingParams


class GetWorkResponse(BaseModel):
    requests: list[WorkItem]
    lease_seconds: float
    models: list[ModelVersion] = Field(default_factory=list)


class WorkResult(BaseModel):
    request_id: str
    model: str
    version: int = 0
    outputs: list[Completion] | None = None
    error: str | None = None
    prompt_tokens: int | None = None


class FinishWorkRequest(BaseModel):
    worker_id: str = "worker-0"
    results: list[WorkResult]


class FinishWorkResponse(BaseModel):
    accepted: int
    duplicates: int
