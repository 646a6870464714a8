"""Wire models of the batch generate queue (ScalarLM 1.151-compatible) and its worker side."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[Any] | None = None


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


class PromptObject(BaseModel):
    """One prompt in object form: plain text or chat messages."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = None
    messages: list[ChatMessage] | None = None

    @model_validator(mode="after")
    def _one_of(self) -> "PromptObject":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("each prompt object needs exactly one of 'prompt' or 'messages'")
        if self.messages is not None and not self.messages:
            raise ValueError("'messages' must not be empty")
        return self


Prompt = str | PromptObject


class GenerateRequest(SamplingParams):
    """POST /v1/generate. ScalarLM's SDK sends `prompts`, `model`, `max_tokens`."""

    prompts: list[Prompt] = Field(..., min_length=1)
    model: str | None = None
    # Seconds to wait for results before answering (ScalarLM waits; 0 answers once stored).
    wait_seconds: float | None = Field(None, ge=0)
    # Accepted for ScalarLM compatibility; tool calling is served through /v1/chat/completions.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def sampling(self) -> SamplingParams:
        return SamplingParams.model_validate(self.model_dump(include=set(SamplingParams.model_fields)))


class Completion(BaseModel):
    """One of the `n` outputs for a prompt."""

    text: str
    finish_reason: str | None = None
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] | None = None
    cumulative_logprob: float | None = None


RequestStatus = Literal["queued", "leased", "completed", "failed"]


class UploadItem(SamplingParams):
    """One element of the JSON list sent to POST /v1/generate/upload (ScalarLM's SDK writes
    `prompt`, `model`, `max_tokens`, `request_type`); sampling fields may be set per item."""

    prompt: Prompt | None = None
    messages: list[ChatMessage] | None = None
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
